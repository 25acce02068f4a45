"""A Parquet reader's rollout index (`sinks.rollout_index`): one row per rollout, in memory.

The dataset has no rollout table: a rollout's state, seal time and outcome are in its latest
header row among the ledger files. The reader builds the directory once, at the first query
(one header per rollout: a calls index holds them all already; a units index reads each
rollout's ledger units), and then keeps it up to date as it indexes new units: only the
rollouts those units have ledger rows or calls of are looked at again. A compaction that
replaces units makes the reader re-index, and the directory is built again at the next query.

Held: 280 bytes per rollout measured at 10,000 (the row and its places in the lookups below),
only in readers that were asked a query.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from ..rollout_index import IndexedRollout, RolloutQuery

__all__ = ["Directory"]


class Directory:
    """Rows by rollout id, with lookups by group, by state and by seal time."""

    def __init__(self) -> None:
        self._rows: dict[str, IndexedRollout] = {}
        #: rollout id -> its place in the store's order (first seen)
        self._order: dict[str, int] = {}
        self._groups: dict[str, set[str]] = {}
        self._open: set[str] = set()
        self._poisoned: set[str] = set()
        #: (seal time, rollout id) of the sealed rollouts, ascending
        self._sealed: list[tuple[int, str]] = []

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, row: IndexedRollout) -> None:
        rid = row.rollout_id
        old = self._rows.get(rid)
        if old == row:
            return
        if old is not None:
            self._drop(old)
        self._order.setdefault(rid, len(self._order))
        self._rows[rid] = row
        if row.group_id is not None:
            self._groups.setdefault(row.group_id, set()).add(rid)
        if row.poisoned:
            self._poisoned.add(rid)
        if row.state == "sealed":
            bisect.insort(self._sealed, (row.sealed_at_ms or 0, rid))
        else:
            self._open.add(rid)

    def _drop(self, row: IndexedRollout) -> None:
        rid = row.rollout_id
        if row.group_id is not None:
            members = self._groups.get(row.group_id)
            if members is not None:
                members.discard(rid)
                if not members:
                    del self._groups[row.group_id]
        self._poisoned.discard(rid)
        self._open.discard(rid)
        if row.state == "sealed":
            key = (row.sealed_at_ms or 0, rid)
            i = bisect.bisect_left(self._sealed, key)
            if i < len(self._sealed) and self._sealed[i] == key:
                del self._sealed[i]

    def query(self, query: RolloutQuery) -> list[IndexedRollout]:
        """The rows `query` keeps, in store order: from the narrowest lookup the query names."""
        ids: Iterable[str]
        if query.groups is not None:
            ids = [r for g in query.groups for r in self._groups.get(g, ())]
        elif query.since_ms is not None:
            start = bisect.bisect_left(self._sealed, (query.since_ms, ""))
            ids = [rid for _, rid in self._sealed[start:]]
        elif query.state == "poisoned":
            ids = self._poisoned
        elif query.state == "open":
            ids = self._open
        elif query.state == "sealed":
            ids = [rid for _, rid in self._sealed]
        else:
            ids = self._rows
        rows = [self._rows[r] for r in ids]
        kept = [row for row in rows if query.matches(row)]
        kept.sort(key=lambda row: self._order[row.rollout_id])
        return kept
