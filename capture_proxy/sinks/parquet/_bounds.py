"""How much a Parquet file may decompress to, checked before pyarrow reads it.

A store file may come from someone else (docs/security.md). Each page of a Parquet file is
compressed on its own, and its header says how large it is uncompressed; pyarrow allocates that
and decompresses into it. A crafted page of a few megabytes can say, and hold, gigabytes. So
before a file's row groups are read, `check_pages` walks the page headers of the column chunks
about to be read (the Thrift compact encoding of ``PageHeader``, parquet-format's
``parquet.thrift``) and refuses, with `StoreDamaged`, a page that would decompress past
`MAX_PAGE_BYTES` or a read whose pages would together pass `MAX_READ_BYTES`. The writer never
comes near either: a page holds at most one value past its 1 MiB target, and a blob is at most
128 MiB (`MAX_BLOB_BYTES`).

A header that cannot be parsed is left to pyarrow, which refuses it with its own error.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from ..base import StoreDamaged

__all__ = ["CHECKED_READS", "MAX_PAGE_BYTES", "MAX_READ_BYTES", "CheckedReads", "check_pages"]

#: A page that decompresses past this is refused: one blob at the 128 MiB a store's blob may
#: hold (`MAX_BLOB_BYTES`), and room for the rest of its row.
MAX_PAGE_BYTES = 144 << 20
#: The pages of one read (a file's row groups or columns asked for) may not decompress past this
#: (a unit's row groups hold 16 MiB; a compacted file read whole, by gc, stays far under it).
MAX_READ_BYTES = 1 << 30
#: Reads whose pages `CheckedReads` remembers as checked. A proxy reads each new unit's files as
#: it indexes them and then mostly the newest units again (resumes, manifests): a few thousand
#: cover those (about 0.3 KB each); an older read that fell out is checked again.
CHECKED_READS = 4096
#: parquet-cpp's own limit on a page header's size.
_MAX_HEADER_BYTES = 16 << 20


class _Short(Exception):
    """The header runs past the bytes read so far."""


class _Bad(Exception):
    """Not a page header: pyarrow will say what is wrong."""


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Short()
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 70:
                raise _Bad()

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, n: int) -> None:
        if n < 0:
            raise _Bad()
        self.pos += n
        if self.pos > len(self.data):
            raise _Short()

    def skip_value(self, kind: int, depth: int = 0) -> None:
        if depth > 64:
            raise _Bad()
        if kind in (1, 2):  # bool: in the field header
            return
        if kind == 3:
            self.skip(1)
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.skip(8)
        elif kind == 8:
            self.skip(self.varint())
        elif kind in (9, 10):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(size):
                self.skip_value(head & 0x0F if head & 0x0F not in (1, 2) else 3, depth + 1)
        elif kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip_value(types >> 4, depth + 1)
                    self.skip_value(types & 0x0F, depth + 1)
        elif kind == 12:
            self.struct(depth + 1)
        else:
            raise _Bad()

    def struct(self, depth: int = 0) -> dict[int, int]:
        """Skip a struct; return its integer fields by id."""
        ints: dict[int, int] = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return ints
            kind, delta = head & 0x0F, head >> 4
            field = last + delta if delta else self.zigzag()
            last = field
            if kind in (4, 5, 6):
                ints[field] = self.zigzag()
            else:
                self.skip_value(kind, depth)


def _page(f: pa.NativeFile, at: int, end: int) -> tuple[int, int, int]:
    """(header bytes, compressed size, uncompressed size) of the page at `at`."""
    want = 256
    while True:
        f.seek(at)
        data = f.read(min(want, end - at))
        try:
            r = _Reader(data)
            ints = r.struct()
            return r.pos, ints.get(3, -1), ints.get(2, -1)
        except _Short:
            if len(data) < want or want >= _MAX_HEADER_BYTES:
                raise _Bad() from None
            want *= 4


def check_pages(
    f: pa.NativeFile,
    meta: pq.FileMetaData,
    rel: str,
    groups: Iterable[int] | None = None,
    columns: Iterable[str] | None = None,
) -> None:
    """Raise `StoreDamaged` when reading `groups` (all: None) and `columns` (all: None) of the
    file `rel` would decompress a page past `MAX_PAGE_BYTES`, or all of them past
    `MAX_READ_BYTES`. Reads the page headers only."""
    wanted = None if columns is None else set(columns)
    total = 0
    for g in range(meta.num_row_groups) if groups is None else groups:
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            if wanted is not None and chunk.path_in_schema.split(".")[0] not in wanted:
                continue
            starts = [chunk.data_page_offset]
            if chunk.dictionary_page_offset is not None and chunk.dictionary_page_offset > 0:
                starts.append(chunk.dictionary_page_offset)
            at = min(starts)
            end = min(at + chunk.total_compressed_size, f.size())
            while at < end:
                try:
                    header, compressed, size = _page(f, at, end)
                except _Bad:
                    return  # not a page header: pyarrow refuses the file itself
                if size > MAX_PAGE_BYTES:
                    raise StoreDamaged(
                        f"{rel}: a page of column {chunk.path_in_schema!r} decompresses to "
                        f"{size} bytes, past the {MAX_PAGE_BYTES} a store's page may hold "
                        "(MAX_PAGE_BYTES): a file no writer writes"
                    )
                total += max(size, 0)
                if total > MAX_READ_BYTES:
                    raise StoreDamaged(
                        f"{rel}: its pages decompress to more than {MAX_READ_BYTES} bytes "
                        "(MAX_READ_BYTES): a file no writer writes"
                    )
                if compressed < 0:
                    return
                at += header + compressed


class CheckedReads:
    """The reads (a file, its size, the groups and columns read) whose pages were checked, the
    `limit` most recently used: a proxy reads every unit of the store over weeks, so a memo
    that kept them all would grow with the store (it was cleared at 65,536 reads: up to 18 MB,
    a saw-tooth in the proxy's memory). Shared by the reader threads of a process."""

    def __init__(self, limit: int = CHECKED_READS) -> None:
        self.limit = limit
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, key: Hashable) -> bool:
        """Whether `key` was checked (and is now the most recently used)."""
        with self._lock:
            if key not in self._seen:
                return False
            self._seen.move_to_end(key)
            return True

    def add(self, key: Hashable) -> None:
        with self._lock:
            self._seen[key] = None
            while len(self._seen) > self.limit:
                self._seen.popitem(last=False)
