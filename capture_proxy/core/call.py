"""One admitted call and what is reported about it: the types `Capture` and the flow share.

`Call` carries a call from admission to its outcome; `CallReport` is that outcome as
`Capture.on_outcome` subscribers (the metrics) see it; `CompletionLike` is what the core needs of
a parsed upstream answer; `SAMPLING_KEYS` are the request keys recorded as the call's sampling.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..schemas.events import RolloutEvent
from ..schemas.records import Attachment, CallStatus, CommitCoords
from .experts import ExpertsParent, ExpertsPlan
from .rollouts import RolloutLive

__all__ = [
    "SAMPLING_KEYS",
    "Call",
    "CallReport",
    "CompletionLike",
    "log_claim",
    "sampling_of",
]

log = logging.getLogger("capture_proxy.capture")

#: Request keys that shape sampling. The values actually forwarded upstream are recorded with
#: every call (and covered by its digest): a trainer must know the policy that made each token.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "n",
    "reasoning_effort",
    "chat_template_kwargs",
    "structured_outputs",
    "response_format",
    "tool_choice",
)


class CompletionLike(Protocol):
    """What the core needs from a parsed upstream answer (see `adapters.vllm.Completion`)."""

    @property
    def prompt_token_ids(self) -> array[int]: ...
    @property
    def completion_token_ids(self) -> array[int]: ...
    @property
    def completion_logprobs(self) -> array[float]: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def message(self) -> dict[str, Any]: ...
    @property
    def extras(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class Call:
    """A call admitted by `Capture.begin_call`, until it is completed or failed."""

    call_id: str
    rollout_id: str
    seq: int
    request: Mapping[str, Any]  # the staged (normalized, attachments by reference) request
    attachments: Mapping[str, Attachment]
    request_key: bytes
    retry_of: str | None
    weight_version: int
    admitted_ms: int
    rollout: RolloutLive
    finished: bool = False
    #: Set once staging starts: from then on the call's outcome is the staging's, even if the
    #: client goes away (staging runs to the end without it).
    staging: bool = False
    #: When the flow began (``time.perf_counter()``) and how long the upstream took, when the
    #: flow measured it: reported with the outcome (the proxy's overhead histogram).
    started: float | None = None
    upstream_seconds: float | None = None
    #: A large request (`Capture.begin_call_offloaded`): its record is sealed on a worker thread.
    offload: bool = False
    #: The rollout's previous call was stamped with this higher weight version (a rollback):
    #: recorded in the record's extras and the manifest, never refused.
    weight_version_decreased_from: int | None = None
    #: Bytes reserved against the rollout's byte quota while in flight (the body's size), and
    #: what its record counts once built (`record_bytes`).
    reserved: int = 0
    record_bytes: int = 0
    #: The request's JSON size, when admission encoded it already (`request_identity`).
    request_size: int | None = None
    #: Where its routed experts start (the earlier call it continues), chosen at admission; and
    #: once its record is built, its own entry for the calls after it (`core/experts.py`).
    experts: ExpertsPlan = field(default_factory=ExpertsPlan)
    experts_entry: tuple[bytes, ExpertsParent] | None = None
    #: The request's part of its record's digest, computed while the upstream answers
    #: (`Capture.prepare_record`), so sealing the record after the answer does not redo it.
    request_part: bytes | None = None
    #: The admission claim's write, started by `begin_call` and awaited before the call's final
    #: status (never before forwarding: the upstream call overlaps the write).
    claim: asyncio.Future[RolloutEvent] | None = None
    #: The task that admitted it (the request's handler), cancelled if a weight-update pause
    #: cuts the call (`Capture.cut`), which then sets `cut`: the abort's reason.
    task: asyncio.Task[Any] | None = None
    cut: str | None = None
    #: The upstream replica the call was sent to ("" for a single upstream), recorded on its
    #: record and reported with its outcome.
    replica: str = ""


@dataclass(frozen=True, slots=True)
class CallReport:
    """One call's outcome, reported once to every `Capture.on_outcome` subscriber.

    `coords` is set for ``staged``; `attachments` counts the images of a call that reached
    staging; the timings are None where they were not measured (a refused call has none).
    """

    rollout_id: str
    call_id: str | None
    status: CallStatus
    reason: str
    coords: CommitCoords | None = None
    attachments: int = 0
    stage_seconds: float | None = None
    upstream_seconds: float | None = None
    overhead_seconds: float | None = None
    #: The upstream replica the call went to ("" for a single upstream, or not sent).
    replica: str = ""


def log_claim(call: Call, task: asyncio.Future[RolloutEvent]) -> None:
    # Retrieved here in every case: a call dropped before its end (a cancelled handler) must not
    # leave "exception was never retrieved" noise; its claim then reads as lost_in_crash.
    error = None if task.cancelled() else task.exception()
    if error is not None:
        log.warning(
            "%s: claiming seq %d failed: %s: %s",
            call.call_id,
            call.seq,
            type(error).__name__,
            error,
            extra={"rollout_id": call.rollout_id, "call_id": call.call_id},
        )


def sampling_of(request: Mapping[str, Any]) -> dict[str, Any]:
    return {k: request[k] for k in SAMPLING_KEYS if k in request}
