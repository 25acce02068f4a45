"""`GroupCommitWriter`: one thread owns a SQLite connection and commits queued work in batches.

Callers on an event loop `submit` a function of the connection; the writer thread takes
everything queued (up to `max_batch`) into ONE ``BEGIN IMMEDIATE`` transaction, runs each function
inside its own ``SAVEPOINT`` (a failing one rolls back alone and its caller gets the exception),
then ``COMMIT``s: one fsync for the whole batch. Only after the commit returns is any caller
answered, with one ``loop.call_soon_threadsafe`` per batch. If the commit fails, or SQLite rolls
the whole transaction back on its own (``SQLITE_FULL``, ``SQLITE_IOERR``, ...), every caller of
the batch gets a `StoreError` and nothing of the batch is visible. `check` runs before each batch
and again after its commit, before anyone is answered: when it raises (the file at the store's
path is no longer the one being written), every caller of the batch gets that error instead.

Why a dedicated thread with `sqlite3` and not aiosqlite: aiosqlite runs each statement as its own
round trip to its thread, so a batch of N records with savepoints would cost several event-loop
hops per record and the batching decision would live on the loop. A writer thread that blocks on a
queue forms the batch itself, does the CPU work of encoding off the loop, and answers everyone
at once (datasette's one-writer-thread-per-file shape).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...schemas.events import RolloutEvent
from ..base import StoreError
from ..writer_thread import Job, Outcome, WriterThread

__all__ = ["Batch", "GroupCommitWriter", "Work"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Batch:
    """Scratch space shared by the work of one transaction.

    Work puts what it wrote under `pending` (for later work of the same batch to see); the
    writer hands `pending` to its `publish` callback only once the batch has committed.
    """

    pending: dict[str, Any] = field(default_factory=dict)
    #: Events the batch's work appended, in order; those of a job that rolled back are dropped.
    #: `publish` gets them once the batch has committed (the store head advances past them).
    events: list[RolloutEvent] = field(default_factory=list)


#: A unit of work: runs on the writer thread, inside a savepoint of the batch's transaction.
Work = Callable[[sqlite3.Connection, Batch], Any]


class _BatchLost(Exception):
    """SQLite rolled back the whole transaction on its own."""


class GroupCommitWriter(WriterThread[Work]):
    """Owns `conn` (autocommit mode) from now on; closes it when `close` has drained the queue.

    `publish` receives each committed `Batch`, on the writer thread. `check`
    (on the writer thread) raises `StoreError` when the batch must not be acknowledged.
    """

    kind = "sqlite"

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        name: str,
        max_batch: int,
        publish: Callable[[Batch], None],
        check: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name=name, max_batch=max_batch)
        #: Set at close when the file alone does not hold every record (said on the log).
        self.incomplete: str | None = None
        self._conn = conn
        self._publish = publish
        self._check = check
        self.start()

    def _on_exit(self) -> None:
        # Leave one self-contained file: fold the WAL into the database and truncate it, so a
        # user who copies only `capture.db` after a clean stop copies every record. Another
        # process reading the file keeps the WAL in use (SQLite then waits `busy_timeout` for
        # it): the frames its snapshot holds are still copied, and the file is whole, its
        # `-wal` redundant. A reader on an older snapshot keeps the frames after it out of the
        # file: that is said loudly (`incomplete`), the records being safe in the `-wal`.
        try:
            busy, frames, copied = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.Error as e:
            self.incomplete = (
                f"{self.name}: could not fold the WAL into the file at close ({e}); its records "
                f"are in {self.name}-wal: keep it with the file"
            )
            log.error("%s", self.incomplete)
        else:
            if busy and copied < frames:
                self.incomplete = (
                    f"{self.name}: {frames - copied} of {frames} WAL frames are not in the file "
                    "at close: an outside reader holds an older snapshot of it; its records are "
                    f"in {self.name}-wal: keep that with the file (a copy of the file alone "
                    "misses them), or open the store once the reader is gone"
                )
                log.error("%s", self.incomplete)
            elif busy:
                log.info(
                    "%s: an outside reader keeps the WAL in use at close; every frame is in the "
                    "file (%s-wal is redundant)",
                    self.name,
                    self.name,
                )
        self._conn.close()

    def _commit(self, jobs: list[Job[Work]]) -> None:
        conn = self._conn
        batch = Batch()
        outcomes: list[Outcome] = []
        try:
            self._check()
            conn.execute("BEGIN IMMEDIATE")
            for job in jobs:
                conn.execute("SAVEPOINT job")
                mark = len(batch.events)
                try:
                    value = job.work(conn, batch)
                except Exception as e:
                    del batch.events[mark:]
                    self._undo_job(conn, e)
                    outcomes.append((job.future, None, self._job_error(e)))
                else:
                    conn.execute("RELEASE job")
                    outcomes.append((job.future, value, None))
            conn.execute("COMMIT")
            # After the commit too: a file deleted or replaced meanwhile got this batch, and
            # nobody will read it there, so nobody is told it is stored.
            self._check()
        except BaseException as e:
            # BaseException too: whatever stops this batch, every waiting caller must hear it.
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    log.exception("%s: rollback after a failed batch failed", self.name)
            cause = e.__cause__ if isinstance(e, _BatchLost) and e.__cause__ is not None else e
            outcomes = [(job.future, None, self._batch_error(cause)) for job in jobs]
        else:
            self._committed(jobs)
            try:
                self._publish(batch)
            except Exception:  # a cache update must not turn committed work into an error
                log.exception("%s: publishing a committed batch failed", self.name)
        self._deliver(jobs, outcomes)

    @staticmethod
    def _undo_job(conn: sqlite3.Connection, error: Exception) -> None:
        try:
            conn.execute("ROLLBACK TO job")
            conn.execute("RELEASE job")
        except sqlite3.Error:
            raise _BatchLost() from error
        if not conn.in_transaction:
            raise _BatchLost() from error

    def _job_error(self, e: Exception) -> Exception:
        # SQLite errors become StoreError (one sentence naming the file); anything else (an
        # encoding error, a fault hook) reaches the caller as it was raised.
        if isinstance(e, sqlite3.Error):
            err = StoreError(f"writing to {self.name} failed, nothing of it was stored: {e}")
            err.__cause__ = e
            return err
        return e

    def _batch_error(self, e: BaseException) -> Exception:
        if isinstance(e, StoreError):  # already one sentence naming the file (`check`)
            return StoreError(str(e))  # one instance per caller: each raise adds its traceback
        err = StoreError(
            f"writing a batch to {self.name} failed ({type(e).__name__}: {e}); nothing of "
            "this batch was stored"
        )
        err.__cause__ = e
        return err
