"""Handing the C heap's free pages back to the system (``--malloc-trim-interval``).

Memory that Arrow, the Parquet writer and Python's larger objects free goes back to the C
library's allocator, not to the system. glibc's malloc returns the top of a heap once enough of
it is free, but the free pages *inside* a heap stay resident until something reuses them, and a
proxy has many heaps: glibc gives its worker threads, Arrow's I/O threads and the writer
thread arenas of their own, each keeping its free chunks. A soak's proxy writing Parquet held a
growing share of its heap free (after the second minute about half of the heap's growth per call
was free, docs/reports/reliability.md section 6), so its RSS rose faster than what it held.

glibc's ``malloc_trim(0)`` merges each arena's small free chunks (so that they are reused) and
gives its whole free pages back (``madvise``), without moving anything: what is in use stays
where it is and a later allocation of those pages just faults them in again. ``serve`` calls
it every ``--malloc-trim-interval`` seconds on a worker thread (it locks one arena at a time
while it walks its free chunks, about a millisecond for a proxy's heap; the event loop is not
held), and not at all with ``0`` or where the C library has no ``malloc_trim`` (musl, macOS).

Large buffers are a second matter (`fix_mmap_threshold`): glibc serves an allocation over its
*mmap threshold* from a mapping of its own, unmapped when freed, but it raises that threshold to
the size of every such block freed (up to 32 MiB), and from then on serves blocks that large from
a heap, where their pages stay resident once freed. An image session's request is tens of MiB
of base64 strings and decoded images: three at once peaked at 3.4-4.2x their bodies depending
on which thread's heap took which block (issue 27). ``serve`` fixes the threshold at 1 MiB.

Third, how many heaps (`limit_arenas`): glibc gives threads that meet in malloc arenas of their
own, up to eight per core, and each keeps free runs of its own that only its threads reuse.
A Parquet proxy's threads (the event loop, its worker threads, the writer thread, Arrow's) had
15 arenas on two cores. With two, soaks side by side kept half the free heap (2.4-3.5 MiB
instead of 6.3-7.5) and 0.5-2.1 MiB less RSS at the same calls, at the same rate; no RSS slope
was told apart in 7 and 12 minutes (docs/reports/reliability.md, section 6).
``serve`` sets two unless ``MALLOC_ARENA_MAX`` is in its environment (glibc reads it itself).

Fourth, Arrow's own allocator (`arrow_on_malloc`). pyarrow's wheels allocate through mimalloc,
which reserves 1 GiB of address space and keeps what it freed resident; the Parquet sink points
pyarrow's Python calls at malloc (`pyarrow.set_memory_pool`), but the Parquet writer's encoders
and page buffers take Arrow's C++ default pool, which Arrow chooses once, when pyarrow is
imported, from ``ARROW_DEFAULT_MEMORY_POOL``. A soak's proxy held 4-6 MB resident in mimalloc's
reservation, growing 15-34 bytes per call (docs/reports/reliability.md, eleventh round).
``serve`` sets the variable to ``system`` before anything imports pyarrow, unless the operator
set it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

__all__ = [
    "ARENAS",
    "MMAP_THRESHOLD",
    "HeapTrim",
    "arrow_on_malloc",
    "fix_mmap_threshold",
    "limit_arenas",
    "malloc_trim",
]

log = logging.getLogger("capture_proxy")


#: Blocks at least this large get a mapping of their own, returned to the system when freed.
MMAP_THRESHOLD = 1 << 20
#: glibc's ``mallopt`` parameter number for it (malloc.h).
_M_MMAP_THRESHOLD = -3


def fix_mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `size` bytes (which also stops glibc from raising it);
    False where the C library has no ``mallopt`` or refuses."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, size))


#: The malloc arenas `serve` allows: the main heap and one for every other thread.
ARENAS = 2
#: glibc's ``mallopt`` parameter number for the arena limit (malloc.h).
_M_ARENA_MAX = -8


def limit_arenas(arenas: int = ARENAS, environ: Mapping[str, str] | None = None) -> bool:
    """Let glibc create at most `arenas` malloc arenas from now on (threads share them), unless
    ``MALLOC_ARENA_MAX`` is set in `environ` (default: the process's): glibc took that one at
    start. False where that variable is set or the C library has no ``mallopt``."""
    if "MALLOC_ARENA_MAX" in (os.environ if environ is None else environ):
        return False
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, arenas))


def arrow_on_malloc(environ: MutableMapping[str, str] | None = None) -> bool:
    """Make Arrow's C++ default pool the C library's ``malloc`` (``ARROW_DEFAULT_MEMORY_POOL=
    system`` in `environ`, default the process's), so the Parquet writer's buffers go to the heap
    that `HeapTrim` trims. Arrow reads the variable when pyarrow is imported: False, and nothing
    changed, when pyarrow is already imported or the variable is already set."""
    env = os.environ if environ is None else environ
    if "ARROW_DEFAULT_MEMORY_POOL" in env or "pyarrow" in sys.modules:
        return False
    env["ARROW_DEFAULT_MEMORY_POOL"] = "system"
    return True


def _mallopt() -> Callable[[int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)`` as a callable, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


@dataclass
class HeapTrim:
    """Trim the C heap every `interval` seconds while `run` runs (`interval` 0: never).

    `trims` counts the trims done, `last_s` and `max_s` are how long they took (seconds)."""

    interval: float
    trims: int = 0
    last_s: float = 0.0
    max_s: float = 0.0

    async def run(self) -> None:
        """Trim every `interval` seconds until cancelled; return at once when off or where
        there is no ``malloc_trim``."""
        trim = malloc_trim() if self.interval > 0 else None
        if trim is None:
            if self.interval > 0:
                log.info("--malloc-trim-interval: this C library has no malloc_trim; not trimming")
            return
        while True:
            await asyncio.sleep(self.interval)
            # ctypes lets go of the GIL for the call: the loop and the other threads go on.
            self.last_s = await asyncio.to_thread(_timed, trim)
            self.max_s = max(self.max_s, self.last_s)
            self.trims += 1

    def stats(self) -> dict[str, float]:
        """The trims done and how long they took, for ``/metrics`` (names without the
        ``capture_proxy_`` prefix): an operator sees that the trim runs and what it costs."""
        return {
            "heap_trims_total": self.trims,
            "heap_trim_last_seconds": self.last_s,
            "heap_trim_max_seconds": self.max_s,
        }


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started
