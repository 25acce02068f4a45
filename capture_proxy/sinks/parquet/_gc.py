"""Retention for Parquet datasets: remove whole sealed rollouts older than a cutoff.

    capture-proxy gc parquet:///runs/capture --older-than 7d

Only sealed rollouts go, and only whole: their calls, their ledger rows (header, failures,
orphan marks), and every blob and attachment no remaining call refers to. Units are immutable,
so this is a compaction with a filter: the live units from the first to the last one holding
anything that goes are rewritten as one unit without those rows, and its commit marker retires
all of them in one atomic step. A reader sees the dataset before or after, never a mix. The span
is consecutive and the new unit takes the place of its last unit, so every kept row keeps its
place in commit order (ledger rows replay in that order, and later headers win). Rows are
copied as they are, so every remaining record, digest and coordinate reads back identically.

The retired files stay on disk for readers that listed them a moment ago; `capture-proxy
compact` deletes them once its grace period has passed.

gc runs while proxies write, on local folders and object storage alike. It reads every live unit
and writes the rewritten span's files before it takes the dataset's maintenance lease (`_lease`:
one compaction or gc commits at a time), and holds the lease only to check its reading and
commit (`_merge`); when another run merged some of the span's units meanwhile, it deletes its
files and plans again from a new reading (`_ATTEMPTS` times at most).

It needs no writer lock because of the **window rule**: a writer shares a blob or attachment only
with a copy committed less than `DEDUP_WINDOW_S` ago (older ones it stores again, or refuses a
reference without bytes), and gc removes a blob or attachment only when no kept call refers to it
and every copy of it is in a unit committed more than `DEDUP_WINDOW_S + GC_MARGIN_S` ago. So
whatever a writer may still refer to is never removed: a copy young enough to be shared is kept,
whatever it held when gc listed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from ...schemas.records import RolloutState
from ..base import GcStats, Progress, StoreError
from ._checkpoint import Checkpoint, holding
from ._claims import remove_claims
from ._fs import DatasetFS
from ._layout import (
    ATTACHMENTS,
    BLOBS,
    CALLS,
    DEDUP_WINDOW_S,
    GC_MARGIN_S,
    LEDGER,
    Marker,
    check_format,
    list_markers,
    read_table,
)
from ._lease import refuse_if_held
from ._ledger import LedgerState
from ._merge import Prepared, commit, discard, prefetched, prepare, replace_units, small_unit
from ._read_errors import vanished
from ._snapshot import read_markers

__all__ = ["gc_parquet", "load_markers", "replace_units"]

#: Readings a gc makes at most: each time another run merged some of the units it rewrote while
#: it read and wrote them (it holds the lease only to commit), it reads the dataset again.
_ATTEMPTS = 3
#: Units whose small files are fetched ahead at once (concurrently, on object storage) while a
#: pass reads one table of every live unit (bounds the bytes held: a few KB per unit, usually).
_PREFETCH_UNITS = 256
_CALL_REFS = ["call_id", "rollout_id", "request_key", "message_keys", "attachment_shas"]


@dataclass(frozen=True, slots=True)
class _Plan:
    """What goes, and which live units (by position) hold any of it."""

    rollouts: list[str]
    calls: frozenset[str]
    blobs: frozenset[str]
    attachments: frozenset[str]
    touched: tuple[int, ...]

    def select(self, name: str, table: pa.Table) -> pa.Table:
        def among(column: str, values: frozenset[str]) -> pa.ChunkedArray:
            return pc.is_in(table.column(column), value_set=pa.array(sorted(values), pa.string()))

        if name == CALLS:
            drop = among("rollout_id", frozenset(self.rollouts))
        elif name == BLOBS:
            drop = among("key", self.blobs)
        elif name == ATTACHMENTS:
            drop = among("sha256", self.attachments)
        else:
            # The same rule as `_goes`, over the whole table at once.
            orphan = pc.equal(table.column("kind"), "orphan")
            drop = pc.or_(
                among("rollout_id", frozenset(self.rollouts)),
                pc.and_(orphan, among("call_id", self.calls)),
            )
        # is_in is false for nulls (a ledger row without a call id): such rows are kept.
        return table.filter(pc.invert(drop))


def gc_parquet(
    location: str,
    *,
    older_than_ms: int,
    now_ms: int,
    dry_run: bool = False,
    filesystem: pafs.FileSystem | None = None,
    progress: Progress | None = None,
    lease_ttl_s: float = 60.0,
    shared_window_s: float = DEDUP_WINDOW_S + GC_MARGIN_S,
    wait_s: float = 0.0,
) -> GcStats:
    """Remove the rollouts of the Parquet dataset at `location` sealed before
    ``now_ms - older_than_ms``; with `dry_run`, only say what would go. Proxies may write to
    the dataset meanwhile.

    A blob or attachment goes only if no kept call refers to it and all its copies are in
    units committed more than `shared_window_s` ago (the module docstring says why; never set
    it below the writers' dedup window). `bytes_before` / `bytes_after` count the live units
    (what readers read); disk space comes back when a later `compact` deletes the retired
    files. Raises `StoreError` when there is no dataset at `location`, another compaction or
    gc holds the maintenance lease (`lease_ttl_s`: how long it holds after each renewal), or
    other runs merged the units it rewrote at each of its `_ATTEMPTS` readings, and `LeaseLost`
    when this run was fenced before committing. A dry run takes no lease (it commits nothing).
    `wait_s`: how long to wait for the lease, first in line, when another run holds it.
    """
    dfs = DatasetFS(location, filesystem)
    if not check_format(dfs):
        raise StoreError(f"no capture-proxy Parquet dataset at {location}")
    if wait_s <= 0 and not dry_run:
        refuse_if_held(location, "gc", dfs)  # refused at once, before any work
    held_s = 0.0
    for _ in range(_ATTEMPTS):
        # Read, planned and written before the lease (`_merge`); committed holding it.
        checkpoint = Checkpoint(dfs, location)
        live = checkpoint.loaded.live()
        # Steps: reading each live unit's calls (most of the time), then the rewrite.
        steps = len(live) + 1

        def unit_read(done: int, steps: int = steps) -> None:
            if progress is not None:
                progress(done, steps)

        shared_after_ns = time.time_ns() - int(shared_window_s * 1e9)
        span: list[Marker] = []
        pending: Prepared | None = None
        try:
            plan = _plan(dfs, live, now_ms - older_than_ms, shared_after_ns, unit_read)
            if plan.touched and not dry_run:
                span = live[plan.touched[0] : plan.touched[-1] + 1]
                pending = prepare(dfs, span, plan.select)
        except OSError as e:
            if isinstance(e, FileNotFoundError) or vanished(e):
                continue  # a unit merged and deleted by another run since the reading
            raise
        before = after = sum(m.size for m in live)
        if dry_run:  # commits nothing: no lease
            break
        try:
            with holding(checkpoint, "gc", ttl_s=lease_ttl_s, wait_s=wait_s):
                # Committed only if every unit it rewrote is still live (read again if another
                # run took the lease since): else planned again from a new reading.
                # Nothing to remove: the lease was taken for `hold`'s repair only.
                live_now = {m.unit for m in checkpoint.loaded.live()}
                if pending is not None and pending.committable(live_now):
                    merge, pending = pending, None  # `commit` removes its files on failure
                    (merged,) = commit(
                        dfs,
                        [merge],
                        checkpoint.existing(),
                        gate=checkpoint.gate_all,
                        undo=checkpoint.undo,
                    )
                    after = before - sum(m.size for m in span) + merged.size
        finally:
            held_s += checkpoint.lease_held_s
            if pending is not None:
                discard(dfs, [pending])
        if pending is None:
            break
    else:
        raise StoreError(
            f"gc of {location} stopped: other maintenance runs merged the units it was "
            f"rewriting, {_ATTEMPTS} times while it read them; nothing was committed, run it again"
        )
    if plan.touched and not dry_run:
        # After the unit that removes their rows, and after the lease is released (a listing
        # and a bulk delete per rollout; no other maintenance run touches claims): a crash in
        # between leaves claims of a rollout that is gone, which a new rollout of the same id
        # would continue after.
        remove_claims(dfs, plan.rollouts)
    unit_read(steps)
    return GcStats(
        rollouts=plan.rollouts,
        calls=len(plan.calls),
        blobs=len(plan.blobs),
        attachments=len(plan.attachments),
        bytes_before=before,
        bytes_after=after,
        lease_held_s=round(held_s, 3),
    )


def _plan(
    dfs: DatasetFS,
    live: Sequence[Marker],
    cutoff_ms: int,
    shared_after_ns: int,
    unit_read: Callable[[int], None],
) -> _Plan:
    ledger = LedgerState()
    ledger_rows: list[list[dict[str, Any]]] = [[] for _ in live]
    for i, table in _each_file(dfs, live, LEDGER):
        ledger_rows[i] = table.to_pylist()
    for rows in ledger_rows:
        ledger.apply(rows)
    sealed = [
        (info.sealed_at_ms, rollout_id)
        for rollout_id, info in ledger.rollouts.items()
        if info.state is RolloutState.SEALED
        and info.sealed_at_ms is not None
        and info.sealed_at_ms < cutoff_ms
    ]
    rollouts = [r for _, r in sorted(sealed, key=lambda s: s[0])]  # stable: ties keep ledger order
    if not rollouts:
        return _Plan([], frozenset(), frozenset(), frozenset(), ())
    going, touched = set(rollouts), set()
    calls: set[str] = set()
    blob_refs: set[str] = set()
    attachment_refs: set[str] = set()
    for i, table in _each_file(dfs, live, CALLS, _CALL_REFS, unit_read):
        t = table.to_pydict()
        for call_id, rollout_id, request_key, keys, shas in zip(
            *(t[c] for c in _CALL_REFS), strict=True
        ):
            if rollout_id in going:
                calls.add(call_id)
                touched.add(i)
            else:
                blob_refs.add(request_key)
                keys = keys or b""
                blob_refs.update(keys[j : j + 32].hex() for j in range(0, len(keys), 32))
                attachment_refs.update(shas or ())
    blobs = _unreferenced(dfs, live, BLOBS, "key", blob_refs, touched, shared_after_ns)
    attachments = _unreferenced(
        dfs, live, ATTACHMENTS, "sha256", attachment_refs, touched, shared_after_ns
    )
    for i, rows in enumerate(ledger_rows):
        if any(_goes(r, going, calls) for r in rows):
            touched.add(i)
    return _Plan(
        rollouts, frozenset(calls), frozenset(blobs), frozenset(attachments), tuple(sorted(touched))
    )


def _goes(row: dict[str, Any], rollouts: set[str], calls: set[str]) -> bool:
    """A ledger row that goes: any row of a removed rollout, and orphan marks of removed calls
    (a mark written before its call's rollout was known names no rollout)."""
    return row["rollout_id"] in rollouts or (row["kind"] == "orphan" and row["call_id"] in calls)


def _unreferenced(
    dfs: DatasetFS,
    live: Sequence[Marker],
    table: str,
    column: str,
    referenced: set[str],
    touched: set[int],
    shared_after_ns: int,
) -> set[str]:
    """Keys of `table` that no kept call refers to and that have no copy in a unit committed
    after `shared_after_ns` (a writer may share such a copy: the window rule); adds the units
    holding them to `touched`."""
    holders: dict[str, list[int]] = {}
    young: set[str] = set()
    for i, t in _each_file(dfs, live, table, [column]):
        for key in set(t.column(column).to_pylist()) - referenced:
            holders.setdefault(key, []).append(i)
            if live[i].order > shared_after_ns:
                young.add(key)
    found = set(holders) - young
    for key in found:
        touched.update(holders[key])
    return found


def _each_file(
    dfs: DatasetFS,
    live: Sequence[Marker],
    table: str,
    columns: Sequence[str] | None = None,
    unit_read: Callable[[int], None] | None = None,
) -> Iterator[tuple[int, pa.Table]]:
    """`table`'s file of each live unit that has one, as (the unit's position, its rows or
    `columns`). On object storage the small units' files are fetched ahead, concurrently, a
    chunk of units at a time: read one by one they cost a few round trips each, which made a
    run over a few hundred units take minutes on a busy store. `unit_read` is told each
    unit's position + 1 as it is passed."""
    for start in range(0, len(live), _PREFETCH_UNITS):
        chunk = list(enumerate(live[start : start + _PREFETCH_UNITS], start))
        small = [m.files[table] for _, m in chunk if table in m.files and small_unit(m)]
        with prefetched(dfs, small):
            for i, m in chunk:
                if unit_read is not None:
                    unit_read(i + 1)
                if table in m.files:
                    yield i, read_table(dfs, m.files[table], columns)


def load_markers(dfs: DatasetFS) -> dict[str, Marker]:
    """Every commit marker of the dataset (retired ones too), by unit name; read concurrently
    on object storage. A marker deleted by a cleanup since the listing is left out."""
    return read_markers(dfs, list_markers(dfs))
