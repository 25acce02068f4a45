"""What a Parquet writer keeps in memory between group commits (see `_sink`), and the work it
queues that holds a seq."""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from ...schemas.events import EventKind
from ._claims import SeqClaim
from ._keyed import key_hash
from ._layout import LEDGER
from ._writer import UnitRows, Work

__all__ = ["Claimed", "RecentKeys", "RolloutIds", "RolloutKeys", "handoffs_in"]


@dataclass(slots=True)
class RolloutKeys:
    """A rollout's committed call ids; the handoff event its next event follows, if any."""

    calls: set[str] = field(default_factory=set)
    handoff: dict[str, Any] | None = None


class Claimed:
    """A piece of work that holds `claim`'s seq: the batch settles it with the store first.

    `defer`: the work's rows need no unit of their own (`UnitWriter`): an admission claim, durable
    as its claim file once the batch settled it, whose event rides in the next unit written."""

    __slots__ = ("claim", "defer", "work")

    def __init__(self, claim: SeqClaim, work: Work, *, defer: bool = False) -> None:
        self.claim = claim
        self.work = work
        self.defer = defer

    def __call__(self, batch: UnitRows, part: UnitRows) -> Any:
        return self.work(batch, part)


class RecentKeys:
    """The `limit` keys added or looked up most recently, each for `window_ns` after it was
    added (the window rule: gc may remove older copies)."""

    def __init__(self, limit: int, window_ns: int) -> None:
        self.limit = max(1, limit)
        self.window_ns = window_ns
        self._keys: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        added = self._keys.get(key)
        if added is None or time.time_ns() - added >= self.window_ns:
            return False
        self._keys.move_to_end(key)
        return True

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str, at_ns: int | None = None) -> None:
        """Remember `key` as committed at `at_ns` (default: now)."""
        self._keys[key] = time.time_ns() if at_ns is None else at_ns
        self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)


class RolloutIds:
    """Every rollout id a writer knows is stored, in about 9 bytes each: an 8-byte hash of each
    id in a sorted array, and the ids added since the last merge as they are (at most a
    sixteenth of the whole, and 4,096, whichever is more). A proxy's writer asks it for every
    new rollout and lives for weeks: a set of the ids took about 0.1 KB each, 15 bytes a call.

    A hash may collide (a new rollout in 2**44 on a store of a million rollouts): that rollout
    then reads as stored, so the writer reads the store for it (nothing is there) and writes no
    implicit header for it (readers list it by its calls all the same).
    """

    __slots__ = ("_pending", "_sorted")

    def __init__(self, ids: Iterable[str] = ()) -> None:
        self._sorted = array("Q", sorted({_id_hash(i) for i in ids}))
        self._pending: set[str] = set()

    def __contains__(self, rollout_id: str) -> bool:
        if rollout_id in self._pending:
            return True
        h, held = _id_hash(rollout_id), self._sorted
        i = bisect_left(held, h)
        return i < len(held) and held[i] == h

    def __len__(self) -> int:
        return len(self._sorted) + len(self._pending)

    def add(self, rollout_id: str) -> None:
        self._pending.add(rollout_id)
        if len(self._pending) >= max(4096, len(self._sorted) >> 4):
            # Two sorted runs: sorted() merges them in one pass.
            fresh = sorted({_id_hash(i) for i in self._pending})
            self._sorted = array("Q", sorted(chain(self._sorted, fresh)))
            self._pending = set()

    def update(self, rollout_ids: Iterable[str]) -> None:
        for rollout_id in rollout_ids:
            self.add(rollout_id)


def _id_hash(rollout_id: str) -> int:
    return int.from_bytes(key_hash(rollout_id), "little")


def handoffs_in(rows: UnitRows) -> set[str]:
    """Rollouts with a ``handoff`` event among `rows`."""
    return {
        r["rollout_id"]
        for r in rows.rows[LEDGER]
        if r["kind"] == "event" and r["event_kind"] == EventKind.HANDOFF
    }
