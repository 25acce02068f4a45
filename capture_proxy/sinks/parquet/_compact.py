"""Compaction: merge a Parquet dataset's many small units into a few large files.

    capture-proxy compact parquet:///runs/capture

Every group commit writes a small unit (a few files and a commit marker), so a busy proxy leaves
thousands of small files; readers and Arrow tools are faster on a few large ones. Compaction reads
runs of consecutive live units, writes their rows as one new unit, and commits it with a marker
that *retires* the units it replaces, in one atomic step: a reader (or the proxy, still writing)
sees the old units or the merged one, never both and never neither. Rows are copied as they
are (no re-encoding), so every record, digest and coordinate resolves identically afterwards.

Retired files are not deleted at once: a reader that listed them a moment ago may still be
reading them. A later run deletes units retired more than `grace_s` seconds ago, and leftovers
(files of commits that crashed before their marker) older than that and than `LEFTOVER_AGE_S`
(half an hour: a younger one may be a writer's commit in progress). A reader that listed a unit
before it was retired reads it normally for `grace_s`; one still reading it after that finds a
file gone, re-lists the dataset and reads the merged unit instead (`ParquetSource` retries).

Compaction runs while proxies write, on local folders and object storage alike: writers only add
units, and a merge retires only units it listed. One compaction or gc commits at a time per
dataset: each reads the units and writes its merged units' files first (`_merge`: nothing a
reader sees), then takes the dataset's maintenance lease (`_lease`) only to check its reading and
commit, and a second run is refused naming the holder; the run's merges commit through the
dataset's checkpoint (`_checkpoint`), which fences a run that stalled past its lease. A merge
whose units another run merged first is dropped, its files deleted. The clean-up runs after the
lease is released and deletes in bulk (`_clean`).

`compact_dataset` is the Parquet store kind's `compact` (`capture_proxy.sinks.kinds`): callers
reach it through the registry, which refuses other kinds in one place.
"""

from __future__ import annotations

import time

from ..base import CompactStats, Progress, StoreError
from ._checkpoint import Checkpoint, Loaded, holding
from ._fs import TMP_SUFFIX, DatasetFS
from ._layout import (
    CALLS,
    COMMITS_DIR,
    DEDUP_WINDOW_S,
    GC_MARGIN_S,
    TABLES,
    Marker,
    check_format,
    list_markers,
    unit_files,
)
from ._lease import refuse_if_held
from ._merge import LEFTOVER_AGE_S, Prepared, commit, discard, prepare
from ._read_errors import vanished

__all__ = ["LEFTOVER_AGE_S", "CompactStats", "compact_dataset", "compact_store"]


def compact_store(
    url: str,
    *,
    target_bytes: int = 256 << 20,
    grace_s: float = 600.0,
    progress: Progress | None = None,
) -> CompactStats:
    """Merge the small units of the Parquet store at `url` (a URL or a folder) into units of up
    to `target_bytes`; the same as `capture_proxy.sinks.registry.compact_store`.

    Raises `UnsupportedStoreOperation` for a store of another kind, `StoreError` when there is
    no dataset there or a compaction is already running.
    """
    from ..registry import compact_store as compact

    return compact(url, target_bytes=target_bytes, grace_s=grace_s, progress=progress)


def compact_dataset(
    location: str,
    *,
    target_bytes: int,
    grace_s: float,
    progress: Progress | None = None,
    lease_ttl_s: float = 60.0,
    shared_window_s: float = DEDUP_WINDOW_S + GC_MARGIN_S,
    wait_s: float = 0.0,
) -> CompactStats:
    """The Parquet kind's compaction: merge the dataset at `location` (a local folder or a
    pyarrow filesystem URL), while proxies write to it. Raises `StoreError` when there is no
    dataset there or another compaction or gc holds the dataset's maintenance lease
    (`lease_ttl_s`: how long the lease holds after each renewal), and `LeaseLost` when the run
    was fenced (nothing was committed). `CompactStats.lease_held_s` says how long it held the
    lease, `merges_dropped` how many merges it did not commit because another run merged some
    of their units first. `progress` is told each run of units merged (before the lease is
    taken), then the end of the clean-up. `shared_window_s` is gc's:
    a merged unit younger than that is not merged again until it is older (`_runs`). `wait_s`:
    how long to wait for the lease, first in line, when another run holds it."""
    dfs = DatasetFS(location)
    if not check_format(dfs):
        raise StoreError(f"no capture-proxy Parquet dataset at {location}")
    if wait_s <= 0:
        refuse_if_held(location, "compact", dfs)  # refused at once, before any work
    # Read before the lease: it is used if nobody takes the lease meanwhile (`Checkpoint`).
    checkpoint = Checkpoint(dfs, location)
    runs = _runs(
        checkpoint.loaded.live(), target_bytes, time.time_ns() - int(shared_window_s * 1e9)
    )
    # Steps: each run of units merged (a run of one is kept as it is), then the clean-up.
    steps = len(runs) + 1
    # Merged before the lease is taken (`_merge`): written, not committed.
    pending: list[Prepared] = []
    vanished_runs = 0
    try:
        for done, run in enumerate(runs, 1):
            if len(run) > 1:
                merge = _prepare(dfs, run)
                if merge is None:
                    vanished_runs += 1
                else:
                    pending.append(merge)
            if progress is not None:
                progress(done, steps)
        with holding(checkpoint, "compact", ttl_s=lease_ttl_s, wait_s=wait_s):
            # What the run holds the lease for: its reading is the store's now (read again if
            # another run took the lease since), so a merge whose units are all still live
            # commits; one whose units another run merged first is dropped.
            live = checkpoint.loaded.live()
            names = {m.unit for m in live}
            fresh = [p for p in pending if p.committable(names)]
            stale = [p for p in pending if not p.committable(names)]
            pending = stale  # `commit` removes the files of the merges it was given on failure
            if fresh:
                commit(
                    dfs,
                    fresh,
                    checkpoint.existing(),
                    gate=checkpoint.gate_all,
                    undo=checkpoint.undo,
                )
            else:
                # Nothing merged: the checkpoint is written anyway, so the next opens read the
                # units committed since the last one from it rather than marker by marker.
                checkpoint.commit(checkpoint.loaded.markers)
    finally:
        # Not committed (dropped, or the run failed before its commit): no marker names them.
        discard(dfs, pending)
    after = checkpoint.loaded.live()
    # The lease is released before the clean-up: deleting retired units and leftovers needs
    # no lease (see `_clean`), and on object storage it is most of a run's requests.
    deleted = _clean(dfs, checkpoint.loaded, grace_s)
    if progress is not None:
        progress(steps, steps)
    return CompactStats(
        units_before=len(live),
        units_after=len(after),
        files_before=sum(len(m.files) for m in live),
        files_after=sum(len(m.files) for m in after),
        bytes_before=sum(m.size for m in live),
        bytes_after=sum(m.size for m in after),
        records=sum(m.rows.get(CALLS, 0) for m in after),
        deleted_files=deleted,
        lease_held_s=round(checkpoint.lease_held_s, 3),
        merges_dropped=len(stale) + vanished_runs,
    )


def _runs(live: list[Marker], target_bytes: int, settled_ns: int) -> list[list[Marker]]:
    """Consecutive units grouped up to `target_bytes` (consecutive: ledger order is kept).

    A merged unit takes the order (commit time) of its last unit, and gc judges the age of
    every blob and attachment copy in it by that order. So a unit committed after `settled_ns`
    (its copies may still be shared by writers) that is itself a merge is not merged again
    until it settles: a young tail merged again and again would keep old copies young forever,
    and gc would never remove them. Each young unit is merged at most once while young, which
    delays the removal of its copies by at most gc's window. Settled units merge freely.

    A unit of half `target_bytes` or more is kept as it is: merged with the small units
    committed since, it would be read, encoded and written again whole at every compaction, for
    little gain (measured on moto: 12 s of a 14 s run rewriting a 160 MB unit to add 200
    one-call units to it).
    """

    def young_merge(m: Marker) -> bool:
        return m.order > settled_ns and bool(m.retires)

    def big(m: Marker) -> bool:
        return m.size >= target_bytes // 2

    runs: list[list[Marker]] = []
    for unit in live:
        if (
            runs
            and not young_merge(unit)
            and not big(unit)
            and not any(young_merge(m) or big(m) for m in runs[-1])
            and sum(m.size for m in runs[-1]) + unit.size <= target_bytes
        ):
            runs[-1].append(unit)
        else:
            runs.append([unit])
    return runs


def _prepare(dfs: DatasetFS, run: list[Marker]) -> Prepared | None:
    """`run`'s rows written as one unit's data files, not committed (`_merge.prepare`); None
    when one of its files is gone: another run merged the units and deleted them since this run
    listed them (then the next run merges what is there)."""
    try:
        return prepare(dfs, run, lambda _t, table: table)
    except OSError as e:
        if isinstance(e, FileNotFoundError) or vanished(e):
            return None
        raise


def _clean(dfs: DatasetFS, loaded: Loaded, grace_s: float) -> int:
    """Delete units retired over `grace_s` ago, then unreferenced files older than that and
    than `LEFTOVER_AGE_S`; `loaded` is what the run read (and committed). Returns how many
    files were deleted.

    Runs without the lease, beside writers, readers and other maintenance runs: it deletes
    only what no reader may use any more, as readers judge it. A unit retired by a marker is
    retired in every later listing (a marker that retires it is deleted only once it is itself
    retired, by a marker that inherits what it retired: `replace_units`), so no run merges it
    again; two clean-ups deleting the same files is harmless (a delete of a missing file is
    not an error). Deletes go in bulk: data files first, then their markers, so a crash in
    between leaves retired markers whose files are gone, which readers never open. A retired
    unit whose marker was not read (the checkpoint names it) has the usual file names.
    """
    now_ms = time.time() * 1000
    deadline_ms = now_ms - grace_s * 1000
    leftover_ms = now_ms - max(grace_s, LEFTOVER_AGE_S) * 1000
    markers = loaded.markers
    retired_at = loaded.retired_at()
    listed = set(loaded.names)
    data: list[str] = []
    gone: list[str] = []
    for name, at in retired_at.items():
        if at > deadline_ms or not (name in listed or name in markers):
            continue
        old = markers.get(name)
        data.extend(old.files.values() if old is not None else unit_files(name, TABLES).values())
        gone.append(f"{COMMITS_DIR}/{name}.json")
        listed.discard(name)
    dfs.delete_many(data)
    dfs.delete_many(gone)
    # Leftovers: old files of no listed unit. Listed first, then the markers committed since
    # the run read them are listed too, so a file of a newer unit is never taken.
    candidates: list[str] = []
    for folder in (*TABLES, COMMITS_DIR):
        for entry in dfs.listdir(folder):
            rel = f"{folder}/{entry.name}"
            if entry.mtime_ns / 1e6 <= leftover_ms and (
                entry.name.endswith(TMP_SUFFIX) or folder != COMMITS_DIR
            ):
                candidates.append(rel)
    if candidates:
        units = listed | set(list_markers(dfs))
        gone_set = set(gone)
        referenced = {
            rel
            for m in markers.values()
            if f"{COMMITS_DIR}/{m.unit}.json" not in gone_set
            for rel in m.files.values()
        }
        candidates = [
            rel
            for rel in candidates
            if rel not in referenced
            and not (rel.endswith(".parquet") and rel.rsplit("/", 1)[-1][:-8] in units)
        ]
        dfs.delete_many(candidates)
    return len(data) + len(gone) + len(candidates)
