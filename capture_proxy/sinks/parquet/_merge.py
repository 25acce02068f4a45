"""Merging units, in two steps: written before the maintenance lease, committed holding it.

A compaction or gc replaces a run of consecutive live units by one unit holding their rows (all
of them, or those a gc keeps), committed by a marker that retires them. The heavy part is
reading the units and writing the new unit's data files (`prepare`): on object storage a few
hundred small units take tens of seconds. None of it changes what a reader or writer sees (the
data files are named by a unit no marker names yet), so it is done before the run takes the
lease, and the lease is held only to check and commit (`commit`): one compare-and-swap of the
checkpoint naming every merged unit live and the units they replace retired (`_checkpoint`),
then the merged units' markers. A run that finds, holding the lease, that another run merged
some of its units meanwhile drops those merges (`discard`: their data files are deleted at once)
and commits the others; a run stopped before its commit (killed, fenced) leaves data files no
marker names, which a later compaction's clean-up deletes as leftovers once they are older than
`LEFTOVER_AGE_S` (`_compact`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Collection, Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ._fs import DatasetFS
from ._index import SMALL_UNIT_BYTES
from ._layout import (
    ATTACHMENTS,
    BLOBS,
    CALLS,
    LEDGER,
    TABLES,
    Marker,
    conform,
    encode_table,
    read_table,
    unit_files,
)
from ._snapshot import fetch_files

__all__ = [
    "COMMIT_WITHIN_S",
    "LEFTOVER_AGE_S",
    "Prepared",
    "Select",
    "commit",
    "discard",
    "prefetched",
    "prepare",
    "replace_units",
    "small_unit",
]

#: A data file no marker names is a leftover of a crashed commit once it is this old, whatever
#: the grace period says (`_compact._clean` deletes it): younger, it may be a commit in progress
#: (data files written, marker next), a writer's or a maintenance run's.
LEFTOVER_AGE_S = 1800.0
#: A merge is committed only within this long of its data files' writing (else it is dropped,
#: and merged again by the next run): half `LEFTOVER_AGE_S`, so no clean-up takes its files for
#: a leftover, even judged by a host whose clock is some minutes ahead.
COMMIT_WITHIN_S = LEFTOVER_AGE_S / 2
#: Per table, the key a row is unique by: a rewritten file keeps the first copy (as readers do).
_UNIQUE = {CALLS: "call_id", BLOBS: "key", ATTACHMENTS: "sha256"}
#: A row filter: (table name, the span's rows of that table) -> the rows to keep.
Select = Callable[[str, pa.Table], pa.Table]
#: Commits the merged units' markers to the checkpoint before the markers are written (raising
#: there commits nothing), and its undo (False: it could not be undone).
Gate = Callable[[Sequence[Marker]], None]
Undo = Callable[[], bool]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A merge written and not committed: the units it replaces and the new unit's marker (its
    data files written, the marker not)."""

    span: tuple[Marker, ...]
    marker: Marker
    #: When its data files were written (`time.monotonic`, taken before the writes).
    written_at: float

    @property
    def replaces(self) -> frozenset[str]:
        return frozenset(m.unit for m in self.span)

    def committable(self, live: Collection[str]) -> bool:
        """Whether it may still be committed, `live` being the dataset's live units as read
        holding the lease: every unit it replaces is still live (no other run merged one), and
        its files are younger than `COMMIT_WITHIN_S` (no clean-up takes them for leftovers)."""
        return self.replaces <= set(live) and time.monotonic() - self.written_at < COMMIT_WITHIN_S


def prepare(dfs: DatasetFS, span: Sequence[Marker], select: Select) -> Prepared:
    """Write the rows of the consecutive live units `span`, filtered by `select`, as the data
    files of a new unit (no marker yet: nothing is committed). Raises what reading a unit
    raised, after removing what it wrote (a file gone: another run merged the unit and deleted
    it since this run listed it).

    The new unit takes the order of the last unit it replaces, so its rows keep their place
    among the other units. A table left without rows gets no file (a unit may be a marker only:
    it still retires). Ledger rows are kept once each (`_distinct`)."""
    unit = f"{span[-1].order:020d}-{uuid.uuid4().hex[:12]}"
    data: dict[str, bytes] = {}
    rows: dict[str, int] = {}
    files = unit_files(unit, TABLES)
    for t, rel in files.items():
        # The span's tables are held whole below anyway: fetch its small files ahead at once.
        small = [m.files[t] for m in span if t in m.files and small_unit(m)]
        with prefetched(dfs, small):
            parts = [conform(t, read_table(dfs, m.files[t])) for m in span if t in m.files]
        if not parts:
            continue
        table = select(t, pa.concat_tables(parts))
        if t in _UNIQUE:
            table = _first_of_each(table, _UNIQUE[t])
        elif t == LEDGER:
            table = _distinct(table)
        if table.num_rows:
            data[rel] = encode_table(table)
            rows[t] = table.num_rows
    marker = Marker(
        unit=unit,
        files={t: rel for t, rel in files.items() if rel in data},
        rows=rows,
        retires=tuple(m.unit for m in span),
        size=sum(map(len, data.values())),
    )
    merge = Prepared(tuple(span), marker, time.monotonic())
    try:
        dfs.put_all(data)
    except BaseException:
        discard(dfs, [merge])
        raise
    return merge


def commit(
    dfs: DatasetFS,
    merges: Sequence[Prepared],
    markers: Container[str],
    *,
    gate: Gate | None = None,
    undo: Undo | None = None,
) -> list[Marker]:
    """Commit the prepared `merges` (their data files written): `gate` (the run's fenced
    checkpoint write, `_checkpoint`) names them all, then their markers are written. Returns
    the committed markers. `markers` holds the names of the units whose markers exist (retired
    ones too). On failure nothing changed and the merges' files are removed: when a marker
    failed after `gate` returned, `undo` undoes that first (the data files are kept, for the
    checkpoint to name, when it cannot)."""
    done = [_final(p, markers) for p in merges]
    gated = False
    try:
        if gate is not None:
            gate(done)  # the last moment to stop: the markers are the commit
            gated = True
        dfs.put_all({m.rel: m.encode() for m in done})
    except BaseException:
        if gated and (undo is None or not undo()):
            raise
        for m in done:
            with contextlib.suppress(OSError):
                dfs.delete(m.rel)
        discard(dfs, merges)
        raise
    return done


def _final(merge: Prepared, markers: Container[str]) -> Marker:
    """The merged unit's marker as committed now: it retires the span's units and, when their
    markers still exist, the units those retired (a retired unit must never come back to life
    once this marker is itself retired and deleted); created now (compaction's grace period for
    the units it retires runs from this wall time, not from when the data was written)."""
    inherited = [u for m in merge.span for u in m.retires if u in markers]
    return dataclasses.replace(
        merge.marker,
        retires=tuple(dict.fromkeys([*(m.unit for m in merge.span), *inherited])),
        created_at_ms=int(time.time() * 1000),
    )


def discard(dfs: DatasetFS, merges: Collection[Prepared]) -> None:
    """Delete the data files of merges that will not be committed (in bulk)."""
    with contextlib.suppress(OSError):
        dfs.delete_many([rel for p in merges for rel in p.marker.files.values()])


def replace_units(
    dfs: DatasetFS,
    span: Sequence[Marker],
    markers: Container[str],
    select: Select,
    *,
    before_commit: Callable[[Marker], None] | None = None,
    undo_commit: Undo | None = None,
) -> Marker:
    """`prepare` and `commit` in one: write the rows of `span`, filtered by `select`, as one
    unit whose marker retires them all; return that marker. `before_commit` is given the marker
    between the data files and the marker (raising there commits nothing); `undo_commit`
    undoes it when the marker could not be written."""
    merge = prepare(dfs, span, select)

    def gate(done: Sequence[Marker]) -> None:
        if before_commit is not None:
            (marker,) = done
            before_commit(marker)

    (marker,) = commit(dfs, [merge], markers, gate=gate, undo=undo_commit)
    return marker


def small_unit(unit: Marker) -> bool:
    return unit.size <= SMALL_UNIT_BYTES


@contextlib.contextmanager
def prefetched(dfs: DatasetFS, rels: Sequence[str]) -> Iterator[None]:
    """`dfs` serves the files `rels` from memory for the block, fetched concurrently first
    (object storage; nothing on a local folder, where reading in place costs less)."""
    dfs.prefetched = fetch_files(dfs, rels, None)
    try:
        yield
    finally:
        dfs.prefetched = {}


def _first_of_each(table: pa.Table, key: str) -> pa.Table:
    first: dict[str, int] = {}
    for i, k in enumerate(table.column(key).to_pylist()):
        first.setdefault(k, i)
    if len(first) == table.num_rows:
        return table
    return table.take(pa.array(sorted(first.values()), pa.int64()))


def _distinct(table: pa.Table) -> pa.Table:
    """A ledger table with each row once, the first copy kept. Two copies of one row come from
    one unit's rows committed twice: by a maintenance run that stalled past its lease and
    committed after another run had merged the same units (before runs were fenced by the
    checkpoint), so the same rows were live in two merged units; readers would replay each
    event twice. A repeated sequence of rows keeps its order and last-wins outcome once."""
    seen: set[tuple[Any, ...]] = set()
    keep: list[int] = []
    for i, row in enumerate(zip(*(c.to_pylist() for c in table.columns), strict=True)):
        if row not in seen:
            seen.add(row)
            keep.append(i)
    if len(keep) == table.num_rows:
        return table
    return table.take(pa.array(keep, pa.int64()))
