"""A driver's outcome for a rollout, from its JSON body to the rollout's header.

The one path behind ``PUT /admin/rollouts/{id}/outcome`` and `CaptureClient.put_outcome`
(docs/contract.md): the size bound, the body's validation (strict, as every control API body),
the reward check, then `Capture.put_outcome`. No aiohttp here: the library runs it in-process.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..core.capture import Capture
from ..core.outcomes import MAX_OUTCOME_BYTES
from ..errors import NotFound, PayloadTooLarge, Unprocessable
from ..schemas.outcome import RolloutOutcome
from ..schemas.request import RequestValidationError
from .validation import answer_for, check_reward, read_body

__all__ = ["OutcomeBody", "put_outcome"]


class OutcomeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: A number or an object of numbers: checked by `check_reward`, which names the component.
    reward: Any = None
    group_id: str | None = Field(default=None, min_length=1, max_length=256)
    metadata: dict[str, Any] | None = None


def _outcome_of(body: OutcomeBody) -> RolloutOutcome:
    try:
        reward = check_reward(body.reward)
    except RequestValidationError as e:
        raise answer_for(e) from e
    if reward is None and body.group_id is None and body.metadata is None:
        raise Unprocessable(
            "An outcome needs one of `reward`, `group_id`, `metadata` at the top level of the "
            "request body; a later outcome replaces the whole earlier one",
            code="empty_outcome",
            param="",
        )
    return RolloutOutcome(reward, body.group_id, body.metadata, int(time.time() * 1000))


async def put_outcome(capture: Capture, rollout_id: str, raw: bytes) -> dict[str, Any]:
    """Store the outcome in the JSON body `raw` as the rollout's latest; the route's answer:
    ``{"rollout_id", "state", "outcome", "revisions"}``.

    Raises `ProxyError`: 413 ``outcome_too_large`` past `MAX_OUTCOME_BYTES`, 400/422 for a body
    that is not a valid outcome (``param`` names the value), 422 ``empty_outcome``, 404
    ``unknown_rollout``, 409 past the outcomes kept per rollout, 503 ``outcome_not_stored``.
    """
    if len(raw) > MAX_OUTCOME_BYTES:
        raise PayloadTooLarge(
            f"an outcome body is at most {MAX_OUTCOME_BYTES} bytes, got {len(raw)}",
            code="outcome_too_large",
        )
    outcome = _outcome_of(read_body(raw, OutcomeBody))
    try:
        header = await capture.put_outcome(rollout_id, outcome)
    except KeyError as exc:
        raise NotFound(f"no rollout {rollout_id}", code="unknown_rollout") from exc
    return {
        "rollout_id": rollout_id,
        "state": str(header.state),
        "outcome": outcome.to_dict(),
        "revisions": len(header.outcome_history),
    }
