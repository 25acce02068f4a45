"""A rollout this proxy holds in memory while another proxy continued it (a hand-off and back).

Several proxies on one store (a dataset on object storage) may each serve a rollout in turn: a
sandbox moved to another proxy and back finds this one still holding the rollout as it left it.
Its next seq is then one the other proxy's calls hold, and the store refuses the claim
(`DuplicateSeq`). Nothing is lost for that: the proxy reads the rollout again from the store
(`resume_rollout`), takes the next free seq there and stages the call at it (`Capture`'s
``complete_call``); a ledger entry refused at a held seq is written at the next free one. Every
answered call leaves a trace in the store, whatever this proxy held.

The calls still in flight on the stale copy move onto the fresh one (`adopt`), so their seqs
are never handed out again and their records extend the fresh copy's lineage.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .call import Call
from .rollouts import CallOutcome, RolloutLive

__all__ = ["MAX_RESEQ", "adopt", "move_to_next_seq"]

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
