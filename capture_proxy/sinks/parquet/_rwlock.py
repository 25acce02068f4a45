"""A lock for a reader's index: reads share it, a change of the index has it alone.

A `ParquetSource` is shared by a proxy's threads (resumes, the writer's read-ahead, the
follower). Its reads only look at the index (and load rows through caches with locks of their
own), so any number of them run at once; what changes the index (new units, a re-index after
a compaction, a reset) waits for the reads under way and holds off new ones meanwhile (a
change waiting is not starved by a stream of reads). A change holds it only to apply what it
has already read from the store (`_refresh`): never for a request.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["SharedLock"]


class SharedLock:
    """Shared holders (reads) or one exclusive holder (a change), a waiting change first.

    A thread may take `shared` again while it holds it (a read made inside another); it must
    not take `exclusive` while it holds `shared` (that would wait for itself).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting = 0
        self._mine = threading.local()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        depth: int = getattr(self._mine, "depth", 0)
        if depth:  # held by this thread already: a change cannot be under way
            self._mine.depth = depth + 1
            try:
                yield
            finally:
                self._mine.depth = depth
            return
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        self._mine.depth = 1
        try:
            yield
        finally:
            self._mine.depth = 0
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self._mine, "depth", 0):
            raise RuntimeError("a reader's index changed from inside one of its reads")
        with self._cond:
            self._waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
                self._cond.notify_all()  # (reads held off for it wait on while it holds it)
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
