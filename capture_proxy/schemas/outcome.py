"""A rollout's outcome: what the driver (or a judge) says of the episode once it is graded.

The driver sends it with ``PUT /admin/rollouts/{id}/outcome``, while the rollout is open or after
it is sealed. A later outcome replaces the earlier one, and every one is kept, in order, as the
rollout's `RolloutInfo.outcome_history` (the last one is `RolloutInfo.outcome`).

Stores keep the history in the rollout's header: inside its stored metadata, under the reserved
key `OUTCOME_HISTORY_KEY`, which `header_metadata` adds when a header is written and
`split_header_metadata` takes out again when it is read. So every store kind keeps outcomes with
the header it already writes, with no table, column or format change, and a store without
outcomes reads as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .fields import RecordValidationError

__all__ = [
    "OUTCOME_HISTORY_KEY",
    "RESERVED_METADATA_PREFIX",
    "RolloutOutcome",
    "first_non_finite",
    "header_metadata",
    "split_header_metadata",
]

#: Metadata keys starting with this are the proxy's own (the key hash of a keyed rollout, the
#: outcome history): a driver's metadata may not use them.
RESERVED_METADATA_PREFIX = "capture_proxy_"
#: The key of a rollout header's stored metadata that holds its outcome history.
OUTCOME_HISTORY_KEY = "capture_proxy_outcome_history"


def first_non_finite(value: object, path: str = "") -> tuple[str, float] | None:
    """The JSON path and value of the first NaN or infinite number inside `value`, if any."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = first_non_finite(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = first_non_finite(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _finite(field_name: str, value: object) -> float:
    # bool is an int to Python, but `true` is not a reward.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordValidationError(field_name, f"must be a number, got {value!r:.80}")
    number = float(value)
    if not math.isfinite(number):
        raise RecordValidationError(field_name, f"must be a finite number, got {number}")
    return number


@dataclass(frozen=True, slots=True)
class RolloutOutcome:
    """One outcome of a rollout, as the driver sent it and when it was stored.

    `reward` is one number (float64) or an object of named numbers (its components, e.g.
    ``{"correctness": 1.0, "format": 0.5}``); `group_id` names the rollout's group (the rollouts
    of one prompt, for GRPO-style advantages); `metadata` is the driver's, kept as sent. Any of
    the three may be None (not sent). Numbers are finite: NaN and infinities are refused.
    """

    reward: float | Mapping[str, float] | None = None
    group_id: str | None = None
    metadata: Mapping[str, Any] | None = None
    #: When the proxy stored it (ms since the epoch).
    at_ms: int = 0

    def __post_init__(self) -> None:
        reward = self.reward
        if isinstance(reward, Mapping):
            if not reward:
                raise RecordValidationError("reward", "an object of rewards needs one at least")
            components = {}
            for name, value in reward.items():
                if not isinstance(name, str):
                    raise RecordValidationError("reward", f"component names are strings: {name!r}")
                components[name] = _finite(f"reward.{name}", value)
            object.__setattr__(self, "reward", components)
        elif reward is not None:
            object.__setattr__(self, "reward", _finite("reward", reward))
        if self.group_id is not None and (not isinstance(self.group_id, str) or not self.group_id):
            raise RecordValidationError(
                "group_id", f"must be a non-empty string: {self.group_id!r}"
            )
        if self.metadata is not None:
            found = first_non_finite(self.metadata, "metadata")
            if found is not None:
                raise RecordValidationError(found[0], f"must be a finite number, got {found[1]}")

    @property
    def scalar_reward(self) -> float | None:
        """The reward when it is one number; None when it is an object (or not sent)."""
        return self.reward if isinstance(self.reward, float) else None

    @property
    def reward_components(self) -> dict[str, float] | None:
        """The reward's named components when it is an object; None when it is one number."""
        return dict(self.reward) if isinstance(self.reward, Mapping) else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"reward", "group_id", "metadata", "at_ms"}`` (None where not sent)."""
        reward = self.reward
        return {
            "reward": dict(reward) if isinstance(reward, Mapping) else reward,
            "group_id": self.group_id,
            "metadata": None if self.metadata is None else dict(self.metadata),
            "at_ms": self.at_ms,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutOutcome:
        """The outcome `to_dict` wrote (validated again)."""
        return cls(
            reward=data.get("reward"),
            group_id=data.get("group_id"),
            metadata=data.get("metadata"),
            at_ms=int(data.get("at_ms") or 0),
        )


def header_metadata(
    metadata: Mapping[str, Any], history: tuple[RolloutOutcome, ...]
) -> dict[str, Any]:
    """A header's metadata as stored: the driver's, plus the outcome history when there is one."""
    stored = dict(metadata)
    if history:
        stored[OUTCOME_HISTORY_KEY] = [o.to_dict() for o in history]
    return stored


def split_header_metadata(
    stored: Mapping[str, Any],
) -> tuple[dict[str, Any], tuple[RolloutOutcome, ...]]:
    """A header's stored metadata as the driver's metadata and the outcome history.

    Raises `RecordValidationError` when the stored history is not one `header_metadata` wrote.
    """
    metadata = dict(stored)
    raw = metadata.pop(OUTCOME_HISTORY_KEY, None)
    if raw is None:
        return metadata, ()
    if not isinstance(raw, list) or not all(isinstance(o, Mapping) for o in raw):
        raise RecordValidationError(OUTCOME_HISTORY_KEY, "is not a list of outcomes")
    return metadata, tuple(RolloutOutcome.from_dict(o) for o in raw)
