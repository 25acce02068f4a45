"""The rollouts a `Capture` holds in memory: found, resumed from the store, released.

A rollout is held while it has live work; one not held (a restart, an idle release, the
live-rollout cap) is read back from the store (`core/resumes.py`) instead of restarting at seq 0.
Sealed rollouts are remembered by id only, for their 409s. Bound as `Capture` methods.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..sinks.codec import MESSAGE_KEYS
from .rollouts import RolloutLive

__all__ = [
    "ensure_rollout",
    "evict",
    "evict_idle",
    "find_rollout",
    "forget_messages",
    "remember_sealed",
    "rollout",
    "sealed_placeholder",
    "store_caught_up",
    "take_resumed",
]

if TYPE_CHECKING:
    from .capture import Capture

log = logging.getLogger("capture_proxy.capture")

#: Ids of sealed rollouts remembered (not their state) so late calls get their 409 without a
#: store lookup; about 200 bytes each (with the key hash of a keyed rollout). The most recently
#: sealed: a late call comes soon after its rollout's seal (a forgotten one is read from the
#: store, which finds a sealed rollout without holding it by id). 100,000 took 20 MB, filling
#: for over an hour at full rate (docs/reports/reliability.md, section 6).
_SEALED_IDS_KEPT = 4_096


def rollout(cap: Capture, rollout_id: str) -> RolloutLive | None:
    """The rollout as this process holds it now, or None. Never creates one and never reads
    the store: a path that admits, refuses or seals a call resolves it with `ensure_rollout`
    or `find_rollout`, so a rollout this process no longer holds (a restart, eviction)
    resumes from the store instead of restarting at seq 0."""
    live = cap.rollouts.get(rollout_id)
    if live is None and rollout_id in cap._sealed:
        return cap._sealed_placeholder(rollout_id)  # refuses calls; never held live
    return live


def sealed_placeholder(cap: Capture, rollout_id: str) -> RolloutLive:
    return RolloutLive(rollout_id, sealed=True, key_sha256=cap._sealed[rollout_id])


async def ensure_rollout(cap: Capture, rollout_id: str) -> RolloutLive:
    """The live rollout, resumed from the store if an earlier process staged into it.

    Resuming keeps sequence numbers, lineage, retries, seal state, the poisoned flag and the
    rollout's key continuous across a restart of the proxy.
    """
    live = await cap.find_rollout(rollout_id)
    if live is None:
        live = cap.rollouts.get(rollout_id)  # created meanwhile by a concurrent call
        if live is None:
            live = RolloutLive(rollout_id, created_at_ms=int(time.time() * 1000))
            cap._evict()
            cap.rollouts[rollout_id] = live
    return live


async def find_rollout(cap: Capture, rollout_id: str) -> RolloutLive | None:
    """The live rollout, or the store's (then made live), or None: never creates one.

    No lock: concurrent first calls of one rollout may both read the store; the first to
    come back registers its copy and the others use it.
    """
    live = cap.rollouts.get(rollout_id)
    if live is None and rollout_id in cap._sealed:
        return cap._sealed_placeholder(rollout_id)
    if live is not None or cap.resumes is None:
        return live
    return cap._take_resumed(rollout_id, await cap.resumes.read(rollout_id))


def take_resumed(cap: Capture, rollout_id: str, found: RolloutLive | None) -> RolloutLive | None:
    """Hold a rollout read from the store (`Resumes`), unless a copy is held already: the
    one held, or None. Called when the read ends, even after its call gave up waiting."""
    live = cap.rollouts.get(rollout_id)
    if live is not None or found is None:
        return live
    if found.sealed:
        cap.remember_sealed(found)  # looked at for its 409: not held live
        return found
    log.info("resumed rollout %s from the store at seq %d", rollout_id, found.next_seq)
    cap._evict()
    cap.rollouts[rollout_id] = found
    return found


def evict_idle(cap: Capture, idle_s: float) -> list[str]:
    """Release rollouts with nothing in flight and no call for `idle_s` seconds; a later
    call resumes them from the store. Keeps memory bounded by live work, not by every
    rollout ever seen (each holds the index of its token sequences). Returns the ids
    released."""
    if not cap._store_caught_up():
        return []
    cutoff = time.monotonic() - idle_s
    idle = [
        rid
        for rid, r in cap.rollouts.items()
        if r.in_flight == 0 and r.last_active and r.last_active < cutoff
    ]
    for rid in idle:
        del cap.rollouts[rid]
        cap._forget_messages(rid)
    return idle


def remember_sealed(cap: Capture, live: RolloutLive) -> None:
    cap._sealed[live.rollout_id] = live.key_sha256
    while len(cap._sealed) > _SEALED_IDS_KEPT:
        cap._sealed.popitem(last=False)  # forgotten ids are looked up in the store again


def store_caught_up(cap: Capture) -> bool:
    # A rollout may leave memory only when the store holds all of it: a ledger entry still
    # held in memory or still being written would be missing from the resumed rollout, and
    # its sequence number handed out again.
    return not cap.ledger.held and not cap.ledger.late


def evict(cap: Capture) -> None:
    # Oldest idle rollouts first; a rollout seen again later resumes from the store.
    excess = len(cap.rollouts) - cap.max_live_rollouts + 1
    if excess <= 0 or not cap._store_caught_up():
        return
    idle = [rid for rid, r in cap.rollouts.items() if r.in_flight == 0][:excess]
    for rid in idle:
        del cap.rollouts[rid]
        cap._forget_messages(rid)


def forget_messages(cap: Capture, rollout_id: str) -> None:
    # Both memos of a rollout's messages (the digest's here, the stores' blob keys in the
    # codec) hold live work only: without this the codec's would fill to its bound on a
    # proxy that runs for weeks (the soak's RSS slope).
    cap._message_digests.forget(rollout_id)
    MESSAGE_KEYS.forget(rollout_id)
