"""The live files of a Parquet dataset: what Arrow engines (DuckDB, Polars, `pyarrow.dataset`)
read when a trainer reads the dataset's files directly.

A glob of ``calls/*.parquet`` is wrong: it takes files of commits in progress or crashed (no
marker yet, or never) and units a compaction or gc retired (their rows are also in the unit that
replaced them, so they would be read twice, and gc's removed rollouts would come back).
`live_files` lists the commit markers once and returns the files of the committed, not retired
units: one consistent snapshot. Its files stay readable for the grace period of the next
compaction (`capture-proxy compact --grace`, ten minutes by default); a read that finds one
gone takes a new snapshot.

What the files hold is the storage encoding (docs/storage.md): a ``calls`` row has its call's
token *delta* against its parent and its messages as blob keys; ``blobs`` and ``attachments``
may hold a key twice (keep either copy: they are the same bytes). Full records, trajectories and
verified digests come from `capture_proxy.open_store` or `capture-proxy export`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.fs as pafs

from ..base import StoreError
from ._fs import DatasetFS
from ._index import LEDGER_INDEX_COLUMNS, SMALL_UNIT_BYTES
from ._layout import (
    ATTACHMENTS,
    BLOBS,
    CALLS,
    COMMITS_DIR,
    LEDGER,
    SCHEMAS,
    Marker,
    check_format,
)
from ._ranged import open_columns

if TYPE_CHECKING:
    import pyarrow.dataset as pads

__all__ = ["LiveFiles", "fetch_files", "fetched_ahead", "live_files", "read_markers"]

#: Concurrent reads of small objects on object storage (each is one round trip).
READ_WORKERS = 16
#: Units whose small files are fetched ahead at once when a reader indexes new units (bounds
#: the bytes held: at most this many units of up to `SMALL_UNIT_BYTES`, usually a few KB each).
PREFETCH_UNITS = 64
#: The columns a units index reads of each table (`_index.UnitIndex.add_unit`): fetched ahead
#: for a large unit. A read of other columns fetches them itself (`_ranged`).
INDEX_READS: dict[str, tuple[str, ...]] = {
    CALLS: ("call_id", "rollout_id"),
    BLOBS: ("key",),
    ATTACHMENTS: ("sha256",),
    LEDGER: (*LEDGER_INDEX_COLUMNS, "position", "hash"),
}
#: A file opened ahead: the columns fetched, and the file (`DatasetFS.ahead`).
Ahead = tuple[frozenset[str], pa.NativeFile]


def read_markers(
    dfs: DatasetFS, names: Sequence[str], object_url: str | None = None
) -> dict[str, Marker]:
    """The markers `names` (units), read concurrently on object storage (with `object_url`,
    the dataset's URL, one GET each through obstore); one deleted since it was listed (a
    compaction's cleanup) is left out."""
    read = _reader(dfs, object_url)

    def one(name: str) -> Marker | None:
        with contextlib.suppress(FileNotFoundError):
            return Marker.decode(read(f"{COMMITS_DIR}/{name}.json"))
        return None

    found: list[Marker | None]
    if dfs.local or len(names) < 2:
        found = [one(name) for name in names]
    else:
        with ThreadPoolExecutor(min(READ_WORKERS, len(names))) as pool:
            found = list(pool.map(one, names))
    return {name: m for name, m in zip(names, found, strict=True) if m is not None}


def fetch_files(dfs: DatasetFS, rels: Sequence[str], object_url: str | None) -> dict[str, bytes]:
    """The bytes of the files `rels`, fetched concurrently (object storage; {} on a local
    folder, where reading in place costs less). With `object_url` (the dataset's URL) each file
    is one GET through obstore; otherwise pyarrow's filesystem asks for its size first (a HEAD
    per file). A file deleted meanwhile is left out: the reader's own read then finds it gone.
    """
    if dfs.local or not rels:
        return {}
    read = _reader(dfs, object_url)

    def one(rel: str) -> tuple[str, bytes | None]:
        with contextlib.suppress(FileNotFoundError):
            return rel, read(rel)
        return rel, None

    with ThreadPoolExecutor(min(READ_WORKERS, len(rels))) as pool:
        return {rel: data for rel, data in pool.map(one, rels) if data is not None}


def fetched_ahead(
    dfs: DatasetFS, new: list[Marker], object_url: str | None
) -> Iterator[tuple[list[Marker], dict[str, bytes], dict[str, Ahead]]]:
    """`new` in chunks of up to `PREFETCH_UNITS` small units, each with their files (read whole:
    on object storage fetched concurrently), the next chunk's fetched while the caller indexes
    this one (a request's wait overlaps the decoding). A large unit is a chunk of its own: its
    files are opened with the chunks of the columns a units index reads fetched, all its files
    at once (`_ranged`; for `DatasetFS.ahead`), so a restarted proxy's open reads a compacted
    unit in two rounds of requests and indexes it while the small units after it are fetched."""
    chunks: list[list[Marker]] = []
    for m in new:
        last = chunks[-1] if chunks else None
        if last and len(last) < PREFETCH_UNITS and _small(m) and _small(last[0]):
            last.append(m)
        else:
            chunks.append([m])

    def fetch(chunk: list[Marker]) -> tuple[dict[str, bytes], dict[str, Ahead]]:
        if len(chunk) == 1 and not _small(chunk[0]):
            return {}, _opened_ahead(dfs, chunk[0])
        small = [rel for m in chunk for rel in m.files.values()]
        return fetch_files(dfs, small, object_url), {}

    if dfs.local or len(chunks) < 2:
        for chunk in chunks:
            yield chunk, *fetch(chunk)
        return
    with ThreadPoolExecutor(1, "parquet-fetch-ahead") as ahead:
        pending = ahead.submit(fetch, chunks[0])
        for i, chunk in enumerate(chunks):
            files, opened = pending.result()
            if i + 1 < len(chunks):
                pending = ahead.submit(fetch, chunks[i + 1])
            yield chunk, files, opened


def _opened_ahead(dfs: DatasetFS, unit: Marker) -> dict[str, Ahead]:
    """A large unit's files, opened with the columns a units index reads fetched (concurrently);
    none where they are read as before (a local folder, no obstore store)."""
    if dfs.object_store() is None:
        return {}
    wanted = [(rel, INDEX_READS[t]) for t, rel in unit.files.items() if t in INDEX_READS]

    def one(item: tuple[str, tuple[str, ...]]) -> tuple[str, Ahead] | None:
        rel, columns = item
        with contextlib.suppress(FileNotFoundError):  # the reader's own read then says so
            f = open_columns(dfs, rel, columns)
            if f is not None:
                return rel, (frozenset(columns), f)
        return None

    with ThreadPoolExecutor(max(1, len(wanted))) as pool:
        return dict(x for x in pool.map(one, wanted) if x is not None)


def _small(unit: Marker) -> bool:
    return unit.size <= SMALL_UNIT_BYTES


def _reader(dfs: DatasetFS, object_url: str | None) -> Callable[[str], bytes]:
    """Read a file whole: one GET through obstore when the dataset has an object-store URL,
    else through pyarrow. obstore takes credentials from the environment only (pyarrow also
    from profile files): where it cannot open the URL or its GET fails for another reason than
    a missing file, every later read goes through pyarrow, as before obstore was used."""
    if object_url is None or dfs.local:
        return dfs.read
    import obstore
    from obstore.store import from_url

    try:
        store = from_url(object_url.rstrip("/"))
    except Exception:  # a URL or configuration obstore does not take: pyarrow reads it
        return dfs.read
    fallback = False

    def read(rel: str) -> bytes:
        nonlocal fallback
        if not fallback:
            try:
                return bytes(obstore.get(store, rel).bytes())
            except FileNotFoundError:
                raise
            except Exception:  # credentials obstore does not see (a profile file): pyarrow's
                fallback = True
        return dfs.read(rel)

    return read


@dataclass(frozen=True, slots=True)
class LiveFiles:
    """One snapshot of a dataset's live files (see `live_files`)."""

    #: The dataset as given to `live_files`.
    location: str
    #: The pyarrow filesystem `paths` are in (for `pyarrow.dataset` and `pyarrow.parquet`).
    filesystem: pafs.FileSystem
    #: The live units, in commit order.
    units: tuple[Marker, ...]
    _root: str
    _base: str

    def paths(self, table: str = CALLS) -> list[str]:
        """The live files of `table` (``calls``, ``blobs``, ``attachments``, ``ledger``) as paths
        in `filesystem`, in commit order."""
        return [f"{self._root}/{m.files[table]}" for m in self.units if table in m.files]

    def urls(self, table: str = CALLS) -> list[str]:
        """The same files as URLs (``s3://bucket/prefix/calls/...``) or local paths: what
        Polars and DuckDB take."""
        return [f"{self._base}/{m.files[table]}" for m in self.units if table in m.files]

    def schema(self, table: str = CALLS) -> pa.Schema:
        """`table`'s current schema: older files lack columns added since; with this schema
        Arrow engines read them as nulls."""
        return SCHEMAS[table]

    def dataset(self, table: str = CALLS) -> pads.Dataset:
        """A `pyarrow.dataset.Dataset` over `table`'s live files (DuckDB queries it as it is)."""
        import pyarrow.dataset as pads

        return pads.dataset(
            self.paths(table),
            schema=self.schema(table),
            format="parquet",
            filesystem=self.filesystem,
        )


def live_files(location: str, *, filesystem: pafs.FileSystem | None = None) -> LiveFiles:
    """The files of the committed, not retired units of the Parquet dataset at `location` (a
    folder or a pyarrow filesystem URL such as ``s3://bucket/prefix``; `filesystem`: a
    configured pyarrow filesystem `location` is a path in).

    One listing of ``_commits/``, the checkpoint (`_checkpoint`), and one read per marker of
    the units committed since it was written (concurrent on object storage). Raises
    `StoreError` when there is no dataset there.
    """
    dfs = DatasetFS(location, filesystem)
    if not check_format(dfs):
        raise StoreError(f"no capture-proxy Parquet dataset at {location}")
    by_url = "://" in location and filesystem is None and not dfs.local
    from ._checkpoint import load_markers  # it reads markers through this module

    loaded = load_markers(dfs, None, location if by_url else None)
    base = f"{location.split('://', 1)[0]}://{dfs.root}" if by_url else dfs.root
    return LiveFiles(location, dfs.fs, tuple(loaded.live()), dfs.root, base)
