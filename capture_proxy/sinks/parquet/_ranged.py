"""A few columns of a large data file on object storage, fetched in two rounds of requests.

Reading some columns of a Parquet file through pyarrow's S3 filesystem is a string of requests
made one after another: the file's size (a ``HEAD``), its footer, every page header the bounds
check walks (`_bounds.check_pages`, one ranged ``GET`` each) and each column chunk. Indexing a
compacted unit of 10,000 calls made about 70 of them, and on a busy store each waits its turn:
7 s of a restarted proxy's open at load 20 on moto (docs/storage.md).

`open_columns` makes the same read in two rounds: the file's tail (its footer, and its size, in
one ``GET`` of the last `FOOTER_BYTES`), then every column chunk of the columns asked for, all
at once (obstore's `get_ranges`: concurrent, near ranges coalesced). It returns a file whose
reads are served from those bytes, so the page check and pyarrow's decoding make no request; a
read outside them (a footer larger than `FOOTER_BYTES`) is fetched as it comes. A file that
is not on object storage through obstore, or whose chunks would pass `MAX_RANGED_BYTES`, is
read as before (None).
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ._fs import DatasetFS

if TYPE_CHECKING:
    from obstore.store import ObjectStore

__all__ = ["FOOTER_BYTES", "MAX_RANGED_BYTES", "chunk_ranges", "open_columns"]

#: The tail fetched first: a unit's footer (a few KB for its row groups) fits in it.
FOOTER_BYTES = 64 << 10
#: Above this, the chunks asked for are not held in memory at once (read as before).
MAX_RANGED_BYTES = 64 << 20
#: Ranges nearer than this are fetched as one request (the gap is read and dropped).
_COALESCE = 64 << 10


class _Ranges(io.RawIOBase):
    """A read-only file of `size` bytes whose reads come from the ranges held, else `fetch`."""

    def __init__(self, size: int, fetch: Callable[[int, int], bytes]) -> None:
        super().__init__()
        self._size = size
        self._pos = 0
        self._fetch = fetch
        self._starts: list[int] = []
        self._data: list[bytes] = []

    def hold(self, start: int, data: bytes) -> None:
        i = bisect.bisect(self._starts, start)
        self._starts.insert(i, start)
        self._data.insert(i, data)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        if end <= self._pos:
            return b""
        data = self._held(self._pos, end)
        if data is None:
            data = self._fetch(self._pos, end)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def _held(self, start: int, end: int) -> bytes | None:
        i = bisect.bisect(self._starts, start) - 1
        if i < 0:
            return None
        at, data = self._starts[i], self._data[i]
        if end > at + len(data):
            return None
        return data[start - at : end - at]


def chunk_ranges(
    meta: pq.FileMetaData, columns: Sequence[str], groups: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """The byte ranges (start, end) of the column chunks of `columns` in `groups` (None: all):
    what reading them, and checking their pages, reads (as `_bounds.check_pages` walks them)."""
    wanted = set(columns)
    out = []
    for g in range(meta.num_row_groups) if groups is None else groups:
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            if chunk.path_in_schema.split(".")[0] not in wanted:
                continue
            start = chunk.data_page_offset
            if chunk.dictionary_page_offset is not None and chunk.dictionary_page_offset > 0:
                start = min(start, chunk.dictionary_page_offset)
            out.append((start, start + chunk.total_compressed_size))
    return out


def open_columns(
    dfs: DatasetFS,
    rel: str,
    columns: Sequence[str],
    groups: Sequence[int] | None = None,
    *,
    footer_bytes: int = FOOTER_BYTES,
) -> pa.NativeFile | None:
    """The file `rel` with the chunks of `columns` (in `groups`, None: all) fetched (see the
    module docstring), its last `footer_bytes` first; None where it is read as before. Raises
    FileNotFoundError when the file is gone (a compaction's clean-up), as a read would."""
    store = dfs.object_store()
    if store is None:
        return None
    import obstore

    try:
        got = obstore.get(store, rel, options={"range": {"suffix": footer_bytes}})
        size = int(got.meta["size"])
        tail = bytes(got.bytes())
    except FileNotFoundError:
        raise
    except Exception:  # a store obstore cannot read here (`DatasetFS.read`): pyarrow reads it
        return None
    ranges = _Ranges(size, lambda start, end: _fetch(store, rel, start, end))
    ranges.hold(size - len(tail), tail)
    meta = pq.ParquetFile(pa.PythonFile(ranges, mode="r")).metadata
    wanted = [(a, b) for a, b in chunk_ranges(meta, columns, groups) if a >= 0 and b > a]
    wanted = [(a, min(b, size)) for a, b in wanted if a < size - len(tail)]
    if sum(b - a for a, b in wanted) > MAX_RANGED_BYTES:
        return None
    if wanted:
        starts, ends = [a for a, _ in wanted], [b for _, b in wanted]
        try:
            fetched = obstore.get_ranges(store, rel, starts=starts, ends=ends, coalesce=_COALESCE)
        except FileNotFoundError:
            raise
        except Exception:  # a response cut short, say: read as before (pyarrow's retries)
            return None
        for start, data in zip(starts, fetched, strict=True):
            ranges.hold(start, bytes(data))
    ranges.seek(0)
    return pa.PythonFile(ranges, mode="r")


def _fetch(store: ObjectStore, rel: str, start: int, end: int) -> bytes:
    """A read outside the ranges held. An error other than a missing file is an OSError, as
    pyarrow's reads raise (the reader retries the ones that say a response broke off)."""
    import obstore

    try:
        return bytes(obstore.get_range(store, rel, start=start, end=end))
    except FileNotFoundError:
        raise
    except Exception as e:
        raise OSError(f"{rel}: {e}") from e
