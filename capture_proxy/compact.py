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
(files of commits that crashed before their marker) older than that. Run one compaction at a
time per dataset (a lock enforces it on local folders).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from .sinks.base import StoreError
from .sinks.parquet_fs import TMP_SUFFIX, DatasetFS
from .sinks.parquet_layout import (
    ATTACHMENTS,
    BLOBS,
    CALLS,
    COMMITS_DIR,
    COMPACT_LOCK,
    SCHEMAS,
    TABLES,
    Marker,
    check_format,
    encode_table,
    list_markers,
    live_units,
    read_table,
    unit_files,
)
from .sinks.urls import parse_store_url

__all__ = ["CompactStats", "compact_store"]

#: Per table, the key a row is unique by: a merged file keeps the first copy.
_UNIQUE = {CALLS: "call_id", BLOBS: "key", ATTACHMENTS: "sha256"}


@dataclass(frozen=True, slots=True)
class CompactStats:
    """What a compaction did. `*_before` / `*_after` count the live units and their files."""

    units_before: int
    units_after: int
    files_before: int
    files_after: int
    bytes_before: int
    bytes_after: int
    #: Staged calls in the dataset (unchanged by compaction).
    records: int
    #: Files deleted: units retired more than `grace_s` ago, and crashed commits' leftovers.
    deleted_files: int


def compact_store(
    url: str, *, target_bytes: int = 256 << 20, grace_s: float = 600.0
) -> CompactStats:
    """Merge the small units of the Parquet dataset at `url` into units of up to `target_bytes`.

    Raises `StoreError` for a store that is not a Parquet dataset or a compaction already running.
    """
    parsed = parse_store_url(url)
    if parsed.kind != "parquet":
        raise StoreError(f"compact merges Parquet datasets; {url} is a {parsed.kind} store")
    dfs = DatasetFS(parsed.location)
    if not check_format(dfs):
        raise StoreError(f"no capture-proxy Parquet dataset at {parsed.location}")
    with _exclusive(dfs):
        markers = _load_markers(dfs)
        live = live_units(markers)
        after = [
            _merge(dfs, run, markers) if len(run) > 1 else run[0]
            for run in _runs(live, target_bytes)
        ]
        deleted = _clean(dfs, grace_s)
    return CompactStats(
        units_before=len(live),
        units_after=len(after),
        files_before=sum(len(m.files) for m in live),
        files_after=sum(len(m.files) for m in after),
        bytes_before=sum(m.size for m in live),
        bytes_after=sum(m.size for m in after),
        records=sum(m.rows.get(CALLS, 0) for m in after),
        deleted_files=deleted,
    )


def _runs(live: list[Marker], target_bytes: int) -> list[list[Marker]]:
    """Consecutive units grouped up to `target_bytes` (consecutive: ledger order is kept)."""
    runs: list[list[Marker]] = []
    for unit in live:
        if runs and sum(m.size for m in runs[-1]) + unit.size <= target_bytes:
            runs[-1].append(unit)
        else:
            runs.append([unit])
    return runs


def _load_markers(dfs: DatasetFS) -> dict[str, Marker]:
    out = {}
    for name in list_markers(dfs):
        with contextlib.suppress(FileNotFoundError):
            out[name] = Marker.decode(dfs.read(f"{COMMITS_DIR}/{name}.json"))
    return out


def _merge(dfs: DatasetFS, run: list[Marker], markers: dict[str, Marker]) -> Marker:
    """Write `run`'s rows as one unit whose marker retires them; return its marker."""
    # The merged unit takes the order of the last unit it replaces: ledger rows replay in the
    # same place relative to every other unit, and units committed meanwhile still come after.
    unit = f"{run[-1].order:020d}-{uuid.uuid4().hex[:12]}"
    data: dict[str, bytes] = {}
    rows: dict[str, int] = {}
    tables = [t for t in TABLES if any(t in m.files for m in run)]
    files = unit_files(unit, tables)
    for t in tables:
        parts = [read_table(dfs, m.files[t]).cast(SCHEMAS[t]) for m in run if t in m.files]
        table = pa.concat_tables(parts)
        if t in _UNIQUE:
            table = _first_of_each(table, _UNIQUE[t])
        data[files[t]] = encode_table(table)
        rows[t] = table.num_rows
    # Units these retired whose markers still exist stay retired when this unit is itself
    # merged later and its marker deleted: a retired unit must never come back to life.
    inherited = [u for m in run for u in m.retires if u in markers]
    marker = Marker(
        unit=unit,
        files=files,
        rows=rows,
        retires=tuple(dict.fromkeys([*(m.unit for m in run), *inherited])),
        created_at_ms=int(time.time() * 1000),
        size=sum(map(len, data.values())),
    )
    try:
        dfs.put_all(data)
        dfs.put_all({marker.rel: marker.encode()})
    except BaseException:
        for rel in (marker.rel, *data):
            with contextlib.suppress(OSError):
                dfs.delete(rel)
        raise
    return marker


def _first_of_each(table: pa.Table, key: str) -> pa.Table:
    keys = table.column(key).to_pylist()
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    if len(first) == len(keys):
        return table
    return table.take(pa.array(sorted(first.values()), pa.int64()))


def _clean(dfs: DatasetFS, grace_s: float) -> int:
    """Delete units retired over `grace_s` ago, then unreferenced files older than that."""
    deadline_ms = (time.time() - grace_s) * 1000
    markers = _load_markers(dfs)
    deleted = 0
    for m in markers.values():
        if m.created_at_ms > deadline_ms:
            continue
        for name in m.retires:
            old = markers.get(name)
            if old is None:
                continue
            # Data files first, marker last: a crash in between leaves a retired marker whose
            # files are gone, which readers never open (it is retired).
            for rel in old.files.values():
                dfs.delete(rel)
                deleted += 1
            dfs.delete(old.rel)
            deleted += 1
    referenced = {rel for m in _load_markers(dfs).values() for rel in m.files.values()}
    for folder in (*TABLES, COMMITS_DIR):
        for entry in dfs.listdir(folder):
            rel = f"{folder}/{entry.name}"
            stale = entry.mtime_ns / 1e6 <= deadline_ms
            leftover = entry.name.endswith(TMP_SUFFIX) or (
                folder != COMMITS_DIR and rel not in referenced
            )
            if stale and leftover:
                dfs.delete(rel)
                deleted += 1
    return deleted


@contextlib.contextmanager
def _exclusive(dfs: DatasetFS) -> Iterator[None]:
    """One compaction at a time: two would both merge the same units (duplicates)."""
    try:
        lock = dfs.lock(COMPACT_LOCK)
    except BlockingIOError:
        raise StoreError(f"another compaction of {dfs.root} is running") from None
    try:
        yield
    finally:
        lock.release()
