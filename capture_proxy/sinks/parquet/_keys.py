"""What a Parquet writer keeps in memory between group commits (see `_sink`), and the work it
queues that holds a seq."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ...schemas.events import EventKind
from ._claims import SeqClaim
from ._layout import LEDGER
from ._writer import UnitRows, Work

__all__ = ["Claimed", "RecentKeys", "RolloutKeys", "handoffs_in"]


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


def handoffs_in(rows: UnitRows) -> set[str]:
    """Rollouts with a ``handoff`` event among `rows`."""
    return {
        r["rollout_id"]
        for r in rows.rows[LEDGER]
        if r["kind"] == "event" and r["event_kind"] == EventKind.HANDOFF
    }
