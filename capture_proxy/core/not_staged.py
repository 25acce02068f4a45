"""The calls that end without a record: failed after admission, or refused before it. Each is
written to its rollout's ledger (refusals past the rollout's rate folded, `core/refusal_folds.py`)
and reported once to the `Capture.on_outcome` subscribers.

Bound as `Capture` methods.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..errors import Conflict, ProxyError, TooManyRequests
from ..schemas.records import CallStatus, LedgerEntry
from .call import Call, CallReport
from .ids import new_call_id
from .resumes import RESUME_REFUSALS
from .rollouts import CallOutcome

__all__ = ["fail_call", "record_not_staged", "refuse", "reject", "report"]

if TYPE_CHECKING:
    from .capture import Capture


async def fail_call(
    cap: Capture,
    call: Call,
    status: CallStatus,
    reason: str,
    message: str,
    http_status: int | None = None,
) -> None:
    """Record an admitted call that ended without a record (upstream error, abort, ...)."""
    try:
        # No wait for the claim: the ledger entry queues behind it and accounts for the seq
        # whatever became of the claim (an entry at a seq another call claimed is refused
        # and logged by the ledger writer).
        await cap._record_not_staged(call, status, reason, message, http_status)
    finally:
        cap._finish(call)


async def reject(
    cap: Capture, rollout_id: str, reason: str, message: str, http_status: int, *, replica: str = ""
) -> str:
    """Record a call refused before it was admitted (a 4xx); returns its call id.

    The rollout is resolved first (from the store if this process does not hold it), so the
    refusal takes the next sequence number. A sealed rollout's ledger is closed: the refusal
    becomes `Conflict` (409, ``rollout_sealed``) and nothing is written.
    """
    live = await cap.ensure_rollout(rollout_id)
    if live.sealed:
        raise Conflict(f"rollout {rollout_id} is sealed", code="rollout_sealed")
    # A refusal before its call was routed (paused, a body refused before it was decoded)
    # is still one of its pinned replica's calls: its metrics name it.
    replica = replica or live.replica
    if cap.max_rollout_calls and live.refusals >= cap.max_rollout_calls:
        # Its ledger says so already, 10,000 times by default: the rest are counted only.
        cap._report(
            CallReport(rollout_id, None, CallStatus.REJECTED, "rollout_call_quota", replica=replica)
        )
        raise TooManyRequests(
            f"rollout {rollout_id} has had {live.refusals} calls refused: its quota "
            f"(--max-rollout-calls {cap.max_rollout_calls}) is spent, and further refusals "
            f"are not recorded one by one ({reason}: {message})",
            code="rollout_call_quota",
        )
    live.refusals += 1
    if not cap.refusal_folds.take(rollout_id):
        # Past the rollout's rate of ledger rows: one entry will stand for this one and
        # the others of its second (`core.refusal_folds`); metrics still count each.
        call_id = cap.refusal_folds.join(live, reason, message, http_status)
        cap._report(CallReport(rollout_id, call_id, CallStatus.REJECTED, reason, replica=replica))
        return call_id
    call_id = new_call_id()
    seq = live.take_seq()
    entry = LedgerEntry(
        rollout_id,
        call_id,
        seq,
        CallStatus.REJECTED,
        reason,
        message,
        http_status,
        int(time.time() * 1000),
    )
    live.outcomes[call_id] = CallOutcome(
        seq,
        call_id,
        CallStatus.REJECTED,
        reason=reason,
        http_status=http_status,
        message=message,
    )
    cap._report(CallReport(rollout_id, call_id, CallStatus.REJECTED, reason, replica=replica))
    # Held "in flight" until its entry is written: a rollout created by this refusal (an id
    # never seen) may leave memory under the live-rollout cap only once the store has the
    # entry, or a resumed copy would hand its sequence number out again.
    live.enter()
    try:
        await cap.ledger.write(entry)
    finally:
        live.leave()
    return call_id


async def refuse(
    cap: Capture, rollout_id: str, err: ProxyError, *, replica: str = ""
) -> str | None:
    """Record a call refused with `err` before admission; returns its call id. A 409 (the
    rollout is sealed: its ledger is closed) is reported but not written. `replica` is the
    upstream replica the call was for ("" for none), reported with the outcome."""
    if err.status == 409 or err.code in RESUME_REFUSALS:
        # A sealed rollout's ledger is closed; one not read from the store in time has no
        # seq to write at (the read goes on): both counted, neither written.
        cap._report(CallReport(rollout_id, None, CallStatus.REJECTED, err.code, replica=replica))
        return None
    return await cap.reject(rollout_id, err.code, err.message, err.status, replica=replica)


async def record_not_staged(
    cap: Capture,
    call: Call,
    status: CallStatus,
    reason: str,
    message: str,
    http_status: int | None,
    *,
    attachments: int = 0,
    stage_seconds: float | None = None,
) -> None:
    if status is CallStatus.CAPTURE_FAILED:
        call.rollout.poisoned = True
    call.rollout.outcomes[call.call_id] = CallOutcome(
        call.seq,
        call.call_id,
        status,
        reason=reason,
        http_status=http_status,
        message=message,
        retry_of=call.retry_of,
    )
    cap._report(
        CallReport(
            call.rollout_id,
            call.call_id,
            status,
            reason,
            attachments=attachments,
            stage_seconds=stage_seconds,
            replica=call.replica,
        )
    )
    entry = LedgerEntry(
        call.rollout_id,
        call.call_id,
        call.seq,
        status,
        reason,
        message,
        http_status,
        int(time.time() * 1000),
    )
    await cap.ledger.write(entry)


def report(cap: Capture, report: CallReport) -> None:
    for subscriber in cap.on_outcome:
        subscriber(report)
