"""A rollout this proxy holds in memory while another proxy continued it (a hand-off and back).

Several proxies on one store (a dataset on object storage) may each serve a rollout in turn: a
sandbox moved to another proxy and back finds this one still holding the rollout as it left it.
Its next seq is then one the other proxy's calls hold, and the store refuses the claim
(`DuplicateSeq`). Nothing is lost for that: the proxy reads the rollout again from the store
(`resume_rollout`), takes the next free seq there and stages the call at it
(`Handback.to_next_free_seq`, from `Capture`'s ``complete_call``); a ledger entry refused at a
held seq is written at the next free one (`Handback.entry_at_free_seq`, the ledger writer's
``reseq``). Every answered call leaves a trace in the store, whatever this proxy held.

The calls still in flight on the stale copy move onto the fresh one (`adopt`), so their seqs
are never handed out again and their records extend the fresh copy's lineage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..schemas.records import CallStatus, LedgerEntry
from .call import Call
from .resumes import read_with_sink
from .rollouts import CallOutcome, RolloutLive

if TYPE_CHECKING:
    from .capture import Capture

__all__ = ["MAX_RESEQ", "Handback", "adopt", "move_to_next_seq"]

log = logging.getLogger("capture_proxy.capture")

#: How many times a call refused its seq is moved to the next free one before it is recorded as
#: ``capture_failed`` (``duplicate_seq``, at a free seq, poisoning the rollout). Once is enough
#: unless another proxy keeps taking seqs of the same rollout at the same moment: two proxies
#: serving one sandbox at once.
MAX_RESEQ = 3


def adopt(stale: RolloutLive, fresh: RolloutLive, calls: Iterable[Call]) -> int:
    """Move `calls` in flight on `stale` onto `fresh` (the rollout read again from the store);
    returns how many moved. `fresh` continues after the seqs either copy handed out."""
    moved = 0
    for call in calls:
        if call.rollout is not stale or call.finished:
            continue
        stale.leave()
        stale.bytes_reserved -= call.reserved
        fresh.enter()
        fresh.bytes_reserved += call.reserved
        fresh.calls_used += 1
        pending = stale.outcomes.get(call.call_id)
        if pending is not None and call.call_id not in fresh.outcomes:
            fresh.outcomes[call.call_id] = pending
        call.rollout = fresh
        moved += 1
    fresh.next_seq = max(fresh.next_seq, stale.next_seq)
    # What the driver set on the stale copy since it was read (nothing for a rollout another
    # proxy continued in the meantime) is the store's now: the fresh copy holds it as stored.
    fresh.poisoned = fresh.poisoned or stale.poisoned
    return moved


def move_to_next_seq(call: Call) -> int:
    """Give `call` its rollout's next free seq (its rollout already the fresh copy); returns the
    seq it had. Its retry link is looked up again: the other proxy's calls are candidates."""
    live = call.rollout
    old = call.seq
    call.seq = live.take_seq()
    call.retry_of = live.retry_of(call.request_key)
    live.remember_request(call.request_key, call.call_id)
    live.outcomes[call.call_id] = CallOutcome(
        call.seq,
        call.call_id,
        "pending",
        retry_of=call.retry_of,
        weight_version_decreased_from=call.weight_version_decreased_from,
    )
    log.warning(
        "rollout %s: seq %d is held by another call (another proxy continued the rollout): "
        "read it again from the store; call %s goes to seq %d",
        call.rollout_id,
        old,
        call.call_id,
        call.seq,
        extra={"rollout_id": call.rollout_id, "call_id": call.call_id},
    )
    return old


class Handback:
    """What one `Capture` does when its copy of a rollout is stale: reads the rollout again,
    moves its calls and ledger entries to free seqs. `moves` counts the calls moved (the
    ledger entries moved are the ledger writer's `moved`)."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.moves = 0

    async def refreshed(self, rollout_id: str, stale: RolloutLive | None) -> RolloutLive | None:
        """The rollout read again from the store in place of `stale` (its calls in flight
        moved onto it), or the copy another call put in place of `stale` meanwhile; None
        without a store to read, or when the store does not know the rollout. Raises what the
        read raises, `TimeoutError` past ``--rollout-resume-timeout``."""
        cap = self.capture
        current = cap.rollouts.get(rollout_id)
        if current is not None and current is not stale:
            return current
        if cap.source is None:
            return None
        bound = cap.resumes.timeout if cap.resumes is not None else cap.stager.timeout
        # Claims of this process's calls still running are theirs, not lost in a crash.
        mine = frozenset(c.call_id for c in cap.calls.values() if c.rollout_id == rollout_id)
        # The resume's read alone in the bound (the call is answered: a timeout here poisons
        # its rollout); the sink reads what its writes need as they are queued.
        found = await asyncio.wait_for(
            read_with_sink(cap.source, rollout_id, None, mine, answered=True), bound
        )
        current = cap.rollouts.get(rollout_id)
        if current is not None and current is not stale:
            return current
        if found is None:
            return None
        if stale is not None:
            adopt(stale, found, list(cap.calls.values()))
        if found.sealed:  # the other proxy sealed it: held for its 409s only
            cap.rollouts.pop(rollout_id, None)
            cap.remember_sealed(found)
        else:
            cap.rollouts[rollout_id] = found
        return found

    async def to_next_free_seq(self, call: Call) -> bool:
        """Move a call refused its seq (`DuplicateSeq`) to its rollout's next free seq, as the
        store has the rollout now, and claim that; False when it cannot (no store to read, the
        rollout sealed by the proxy that continued it, the store unreadable: logged)."""
        cap = self.capture
        try:
            fresh = await self.refreshed(call.rollout_id, call.rollout)
        except Exception as e:
            log.error(
                "rollout %s: seq %d is another call's, and the store could not be read for a "
                "free one: %s: %s",
                call.rollout_id,
                call.seq,
                type(e).__name__,
                e,
                extra={"rollout_id": call.rollout_id, "call_id": call.call_id},
            )
            return False
        if fresh is None or fresh.sealed:
            return False
        if call.rollout is not fresh:  # a copy another call read: this call was not on it
            adopt(call.rollout, fresh, [call])
        move_to_next_seq(call)
        self.moves += 1
        call.claim = cap.start_claim(call)
        return True

    async def entry_at_free_seq(self, entry: LedgerEntry) -> LedgerEntry | None:
        """A ledger entry the store refused at its seq (another call holds it: this proxy's
        copy of the rollout was stale), at the rollout's next free seq as the store has it now;
        None when there is none (no store to read, an unknown rollout). The ledger writer
        writes it there (`LedgerWriter.reseq`): the call leaves its trace, and a
        ``capture_failed`` one poisons its rollout as it should."""
        cap = self.capture
        fresh = await self.refreshed(entry.rollout_id, cap.rollouts.get(entry.rollout_id))
        if fresh is None:
            return None
        seq = fresh.take_seq()
        before = fresh.outcomes.get(entry.call_id)
        fresh.outcomes[entry.call_id] = CallOutcome(
            seq,
            entry.call_id,
            entry.status,
            reason=entry.reason,
            http_status=entry.http_status,
            message=entry.message,
            retry_of=before.retry_of if before is not None else None,
        )
        if entry.status is CallStatus.CAPTURE_FAILED:
            fresh.poisoned = True
        log.warning(
            "rollout %s: the ledger entry of call %s (%s %s) goes to seq %d: seq %d is held by "
            "another call (another proxy continued the rollout)",
            entry.rollout_id,
            entry.call_id,
            entry.status,
            entry.reason,
            seq,
            entry.seq,
            extra={"rollout_id": entry.rollout_id, "call_id": entry.call_id},
        )
        return replace(entry, seq=seq)
