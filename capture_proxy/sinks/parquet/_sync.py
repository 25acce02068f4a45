"""Making many new files of a local dataset durable at once.

A group commit creates several files at a time: the claim files of its calls, the data files of
its unit. Each must be fsynced, and so must each folder a new name is in. One after another, a
batch of n claims costs 2n flushes in a row (the writer thread waits for each); issued together,
from a few threads, they share the file system's journal commits (ext4 and xfs commit every
waiting fsync of a transaction in one flush), so the batch costs about one flush. Each file and
each folder is still fsynced before anything that depends on it is acknowledged: only the
waiting is shared.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Iterable, Sequence

__all__ = ["fsync_each", "fsync_folders"]

#: Threads issuing fsyncs at once (each only waits on the disk; the GIL is released meanwhile).
_THREADS = 16

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    # A forked child has none of its parent's threads: it starts a pool (and a lock) of its own.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_THREADS, "parquet-fsync")
        return _pool


def fsync_each(fds: Sequence[int]) -> list[OSError | None]:
    """fsync every descriptor, all at once; per descriptor, None or the error its fsync raised.

    Returns only when every fsync has returned (whatever failed), so the caller knows which
    files are durable. The descriptors stay open.
    """
    if len(fds) <= 1:
        return [_fsync(fd) for fd in fds]
    return list(_executor().map(_fsync, fds))


def fsync_folders(paths: Iterable[str]) -> dict[str, OSError | None]:
    """fsync each folder (so the names created or renamed in it are durable), all at once;
    per folder, None or the error that kept it from being synced."""
    folders = sorted(set(paths))
    out: dict[str, OSError | None] = {}
    opened: list[tuple[str, int]] = []
    try:
        for path in folders:
            try:
                opened.append((path, os.open(path, os.O_RDONLY | os.O_DIRECTORY)))
            except OSError as e:
                out[path] = e
        errors = fsync_each([fd for _, fd in opened])
        out.update((path, err) for (path, _), err in zip(opened, errors, strict=True))
    finally:
        for _, fd in opened:
            os.close(fd)
    return out


def _fsync(fd: int) -> OSError | None:
    try:
        os.fsync(fd)
    except OSError as e:
        return e
    return None
