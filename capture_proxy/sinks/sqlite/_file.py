"""The writer's hold on its SQLite file: one writer per file, and the file still being the one.

**One writer.** A lock file beside the store (``<store>.writer.lock``), taken with
``fcntl.flock(LOCK_EX | LOCK_NB)`` before the store is opened and held until the sink closes; it
holds the writer's pid, so a second writer is refused with a sentence naming the file and that
pid. Why a separate lock file and not SQLite's own locking: ``PRAGMA locking_mode = EXCLUSIVE``
in WAL mode keeps every other process out, readers included (trainers and ``inspect`` read while
the proxy writes); and a ``flock`` (or any second descriptor opened and closed) on the database
file itself would interfere with SQLite's POSIX locks on it, which are dropped when *any*
descriptor of the file in the process closes. The lock is advisory: readers, ``gc`` (short
transactions under SQLite's own locking) and other tools are not affected. The kernel releases it
when the process dies, so a crashed writer never leaves a stale lock; the file itself stays
(deleting it would let two writers lock two different files). The lock belongs to the file, not
to the name it was given: it is taken beside the path with every symlink resolved (two proxies
given ``store.db`` and a link to it take one lock), and a store file with more than one hard
link is refused, since no name is then *the* name of the file.

**The same file.** SQLite keeps writing into an open file after it was deleted or replaced
(``rm``, ``mv``, a restore over it): every commit "succeeds" into an inode nobody will read again.
`FileIdentity` remembers the file's ``(st_dev, st_ino)`` at open; the writer checks the path
against it before and after each batch, so no batch is acknowledged once the file at the path is
another (or none), and the proxy's guard checks it once a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading

from ..base import StoreError

__all__ = ["FileIdentity", "WriterLock", "lock_path"]

log = logging.getLogger(__name__)


def lock_path(db_path: str) -> str:
    """The writer lock file of the SQLite store at `db_path` (beside the file links lead to)."""
    return f"{os.path.realpath(db_path)}.writer.lock"


def _refuse_hard_links(db_path: str) -> None:
    try:
        links = os.stat(db_path).st_nlink
    except FileNotFoundError:
        return  # a new store: created by this writer, under the lock
    if links > 1:
        raise StoreError(
            f"the SQLite store {db_path} has {links} hard links: one writer per file is held "
            "by a lock beside the file's one name, so a store must have one; keep one name "
            "and use a symlink for the others"
        )


class WriterLock:
    """The exclusive writer lock of one SQLite store; raises `StoreError` if another holds it."""

    def __init__(self, db_path: str) -> None:
        self.path = lock_path(db_path)
        _refuse_hard_links(db_path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StoreError(
                f"cannot take the writer lock of the SQLite store {db_path}: {e}"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"capture-proxy (pid {holder})" if holder else "writer"
            raise StoreError(
                f"another {who} is writing the SQLite store {db_path}: a store has one writer "
                f"at a time (lock {self.path}); stop it, or give this proxy another --store"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):  # the pid is for the message above only
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class FileIdentity:
    """Whether `path` is still the file the writer opened (by device and inode).

    `problem` is blocking (one ``stat``) and thread-safe; once the file is found gone or
    replaced the answer stays (the writer's connection points at the lost file for good), and
    it is logged once, as an error.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        st = os.stat(path)
        self._identity = (st.st_dev, st.st_ino)
        self._lost: str | None = None
        self._lock = threading.Lock()

    def problem(self) -> str | None:
        """Why the writer's file is no longer the store at its path, or None."""
        if self._lost is not None:
            return self._lost
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            what = "was deleted or moved away"
        except OSError:
            return None  # cannot tell (EACCES, EIO): SQLite's own writes will report it
        else:
            if (st.st_dev, st.st_ino) == self._identity:
                return None
            what = "was replaced by another file"
        with self._lock:
            if self._lost is None:
                self._lost = (
                    f"the SQLite store {self.path} {what} while this proxy was writing it: "
                    "nothing is acknowledged any more (writes would go to the lost file); "
                    "restore the file or restart the proxy"
                )
                log.error("%s", self._lost)
        return self._lost

    def check(self) -> None:
        """Raise `StoreError` if the file is gone or replaced (see `problem`)."""
        reason = self.problem()
        if reason is not None:
            raise StoreError(reason)
