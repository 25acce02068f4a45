"""An append-only byte string whose older bytes live on disk: the home of a long-lived reader's
per-key index bytes (`_index.Locator`, `_index.Packed`), so that its memory does not grow with
the store it indexes.

A Parquet proxy's reader keeps an 8-byte hash per blob and attachment and the packed places of
every sealed rollout: about 20 bytes per call of the store (docs/reports/reliability.md,
twelfth round), so a proxy at 167 calls/s would hold 0.3 GB more every day in memory that only
a resume or a read route ever reads. Here the newest bytes stay in memory (`SPILL_BYTES` at
most) and each time they reach that size they are written to an unnamed temporary file
(``O_TMPFILE``: nothing to clean up after a crash) and mapped read-only. A mapped file's pages
are the page cache's: read when searched, and reclaimable by the kernel, not the proxy's
anonymous memory. Files are merged two into one while the older is at most twice the newer
(up to `MERGE_MAX_BYTES`), so there are a few dozen at most after weeks, each one mapping and
one descriptor.

Where the files go: the system's temporary folder (``TMPDIR``). Where it cannot be written
(full, read-only) the bytes stay in memory and the next attempt is made once they have doubled;
nothing is lost either way, and each failed attempt is logged.

Readers on other threads: `find_aligned` and `read` take one consistent view (the files and the
memory part together, replaced by one assignment when bytes move to a file), so a search that
runs while bytes are appended or moved meets every byte appended before it started.
"""

from __future__ import annotations

import logging
import mmap
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["MERGE_MAX_BYTES", "SPILL_BYTES", "SpillingBytes"]

log = logging.getLogger("capture_proxy")

#: Bytes kept in memory before they move to a file.
SPILL_BYTES = 256 << 10
#: Files are not merged past this size (a merge copies both: bounded work on the adding thread).
MERGE_MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class _Segment:
    """Bytes [base, base + size) of the string, mapped from a file."""

    base: int
    data: mmap.mmap

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class _View:
    """What a reader reads: the files in order, then the memory part from `base`."""

    segments: tuple[_Segment, ...]
    base: int
    hot: bytearray


class SpillingBytes:
    """Bytes appended in whole records (`append` never splits what one call adds between a
    file and memory), found by `find_aligned` and read back by `read`, at offsets counted from
    the first byte ever appended.

    `spill_bytes`: how much stays in memory (default `SPILL_BYTES`; 0: all of it, never a
    file)."""

    __slots__ = ("_next_spill", "_spill_bytes", "_view")

    def __init__(self, spill_bytes: int | None = None) -> None:
        self._spill_bytes = SPILL_BYTES if spill_bytes is None else spill_bytes
        self._next_spill = self._spill_bytes
        self._view = _View((), 0, bytearray())

    def __len__(self) -> int:
        view = self._view
        return view.base + len(view.hot)

    def append(self, data: bytes | bytearray) -> None:
        """Add `data` at the end; a search or read on another thread sees it once this returns."""
        view = self._view
        view.hot.extend(data)
        if self._spill_bytes and len(view.hot) >= self._next_spill:
            self._spill(view)

    def memory_bytes(self) -> int:
        """Bytes held in memory (the part not yet in a file)."""
        return len(self._view.hot)

    def files(self) -> int:
        """Files mapped (one descriptor each)."""
        return len(self._view.segments)

    def find_aligned(
        self, pattern: bytes, step: int, *, newest_first: bool = False
    ) -> Iterator[int]:
        """Offsets where `pattern` starts at a multiple of `step`, ascending (or descending)."""
        view = self._view
        parts: list[tuple[int, mmap.mmap | bytearray]] = [(s.base, s.data) for s in view.segments]
        parts.append((view.base, view.hot))
        # Every part starts at a multiple of `step`: a file holds whole records.
        for base, data in reversed(parts) if newest_first else parts:
            yield from _aligned(data, pattern, step, base, newest_first)

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end), which one `append` added (or several, in one part)."""
        view = self._view
        if start >= view.base:
            return bytes(view.hot[start - view.base : end - view.base])
        for seg in reversed(view.segments):
            if start >= seg.base:
                return seg.data[start - seg.base : end - seg.base]
        raise IndexError(start)

    def _spill(self, view: _View) -> None:
        try:
            seg = _write(view.base, view.hot)
            segments = _merged([*view.segments, seg])
        except OSError as exc:
            self._next_spill = 2 * len(view.hot)
            log.warning(
                "index bytes stay in memory (%d bytes): the temporary folder %s refused them: %s",
                len(view.hot),
                tempfile.gettempdir(),
                exc,
            )
            return
        self._next_spill = self._spill_bytes
        # One assignment: a reader has either the old view (its bytes in memory) or the new.
        self._view = _View(tuple(segments), view.base + len(view.hot), bytearray())


def _write(base: int, *parts: bytes | bytearray | mmap.mmap) -> _Segment:
    with tempfile.TemporaryFile() as f:
        for part in parts:
            f.write(part)
        f.flush()
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _Segment(base, mapped)


def _merged(segments: list[_Segment]) -> list[_Segment]:
    while len(segments) >= 2:
        older, newer = segments[-2], segments[-1]
        if older.size > 2 * newer.size or older.size + newer.size > MERGE_MAX_BYTES:
            break
        joined = _write(older.base, older.data, newer.data)
        segments[-2:] = [joined]
        # The old mappings are left to the collector: a reader on another thread may still be
        # searching them (an `mmap` closed under it would raise).
    return segments


def _aligned(
    data: mmap.mmap | bytearray, pattern: bytes, step: int, base: int, newest_first: bool
) -> Iterator[int]:
    n = len(data)
    if newest_first:
        pos = data.rfind(pattern)
        while pos >= 0:
            if pos % step == 0:
                yield base + pos
            pos = data.rfind(pattern, 0, pos + len(pattern) - 1)
    else:
        pos = data.find(pattern)
        while pos >= 0:
            if pos % step == 0:
                yield base + pos
            pos = data.find(pattern, pos + 1, n)
