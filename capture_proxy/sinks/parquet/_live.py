"""The rollouts a Parquet writer holds in memory, and how it reads one it does not hold.

A writer keeps, for the `max_live` rollouts it used last, what is committed of each
(`RolloutKeys`: its staged call ids, and the ``handoff`` event due before its next one). A
rollout it does not hold is read as the store has it now (`LiveRollouts.keys`): on object
storage another writer may have created it, or continued it since this one last looked (a
hand-off), so its highest claim and its chain's head come from the store. Those reads are made
before the rollout's work is queued, in general (`_resolve.ReadAhead`); this module applies
them, or reads itself when they are no longer true.
"""

from __future__ import annotations

from collections import OrderedDict

from ._claims import Holders, SeqClaim, last_claim
from ._events import EventHeads
from ._fs import DatasetFS
from ._keys import RolloutIds, RolloutKeys
from ._resolve import ReadAhead, handoff_from, stored_chain
from ._source import ParquetSource


class LiveRollouts:
    """The writer's rollouts in memory, least recently used first out (at most `max_live`).

    Used from the writer thread only (the read-ahead threads ask `in` alone)."""

    def __init__(
        self,
        *,
        max_live: int,
        dfs: DatasetFS,
        reader: ParquetSource,
        holders: Holders,
        ahead: ReadAhead,
        events: EventHeads,
        rollouts: RolloutIds,
        writer_id: str,
    ) -> None:
        self.max_live = max(1, max_live)
        self._held: OrderedDict[str, RolloutKeys] = OrderedDict()
        self._dfs = dfs
        self._reader = reader
        self._holders = holders
        self._ahead = ahead
        self._events = events
        self._rollouts = rollouts
        self._writer_id = writer_id

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def get(self, rollout_id: str) -> RolloutKeys | None:
        """What is held of `rollout_id`, without reading the store (None: not held)."""
        return self._held.get(rollout_id)

    def drop(self, rollout_id: str) -> RolloutKeys | None:
        """Stop holding `rollout_id` (its seal committed); what was held of it."""
        keys = self._held.pop(rollout_id, None)
        self._ahead.left(rollout_id)
        return keys

    def refused(self, claim: SeqClaim, holder: str) -> None:
        """Another call holds `claim`'s seq: if this writer did not know it, another writer took
        the rollout on; what is held here of it is stale and is read again at its next use."""
        keys = self._held.get(claim.rollout_id)
        if keys is not None and holder not in keys.calls:
            del self._held[claim.rollout_id]
            self._ahead.left(claim.rollout_id)

    def keys(self, rollout_id: str) -> RolloutKeys:
        """What is committed of `rollout_id` (read from the dataset when not held)."""
        keys = self._held.get(rollout_id)
        if keys is not None:
            self._held.move_to_end(rollout_id)
            return keys
        keys = self._resolve(rollout_id)
        self._held[rollout_id] = keys
        while len(self._held) > self.max_live:
            self._ahead.left(self._held.popitem(last=False)[0])
        return keys

    def rollout_of(self, call_id: str) -> str | None:
        """The rollout of a call held in memory (None: not known here; an orphan mark then
        names no rollout, and readers find it through the call)."""
        for rollout_id, keys in reversed(self._held.items()):
            if call_id in keys.calls:
                return rollout_id
        return None

    def _resolve(self, rollout_id: str) -> RolloutKeys:
        """A rollout this writer does not hold, as the store has it now: another writer may have
        created it, or continued it, since this one last looked (a handoff)."""
        shared = not self._dfs.local  # a local folder has one writer: this one
        now = self._holders.created_now(rollout_id)
        # Read before its job was queued, off this thread (`_resolve.ReadAhead`), in general.
        if shared:
            ahead = self._ahead.keys(rollout_id, self._writer_id, now, self._events)
            if ahead is not None:
                return ahead
        # One listing of its claims: a rollout another writer has taken calls of (a handoff)
        # is read from the store; one nobody has is new, whoever created its header (an
        # implicit header never replaces a stored one, `_ledger`).
        last = last_claim(self._dfs, rollout_id, now)
        if rollout_id not in self._rollouts:
            if last is None or not shared:
                return RolloutKeys()  # new: nothing of it is stored
            self._rollouts.add(rollout_id)
        if shared:
            # One read of the store, for the chain's head. Another writer's call ids are not
            # needed: call ids never repeat across proxies, and a call whose parent another
            # writer staged is stored whole (exact, a few bytes more) instead of read back.
            head, staged = stored_chain(self._reader, rollout_id)
            self._events.reset(rollout_id, head)
            keys = RolloutKeys(set(staged))
        else:
            calls, _ = self._reader.rollout_keys(rollout_id)
            keys = RolloutKeys(calls)
        keys.handoff = handoff_from(last, self._writer_id)
        return keys
