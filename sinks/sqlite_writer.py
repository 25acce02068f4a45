"""`GroupCommitWriter`: one thread owns a SQLite connection and commits queued work in batches.

Callers on an event loop `submit` a function of the connection; the writer thread takes
everything queued (up to `max_batch`) into ONE ``BEGIN IMMEDIATE`` transaction, runs each function
inside its own ``SAVEPOINT`` (a failing one rolls back alone and its caller gets the exception),
then ``COMMIT``s: one fsync for the whole batch. Only after the commit returns is any caller
answered, with one ``loop.call_soon_threadsafe`` per batch. If the commit fails, or SQLite rolls
the whole transaction back on its own (``SQLITE_FULL``, ``SQLITE_IOERR``, ...), every caller of
the batch gets a `StoreError` and nothing of the batch is visible.

Why a dedicated thread with `sqlite3` and not aiosqlite: aiosqlite runs each statement as its own
round trip to its thread, so a batch of N records with savepoints would cost several event-loop
hops per record and the batching decision would live on the loop. A writer thread that blocks on a
queue forms the batch itself, does the CPU work of encoding off the loop, and answers everyone
at once (datasette's one-writer-thread-per-file shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .base import StoreError

__all__ = ["Batch", "GroupCommitWriter", "Work"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Batch:
    """Scratch space shared by the work of one transaction.

    Work puts what it wrote under `pending` (for later work of the same batch to see); the
    writer hands `pending` to its `publish` callback only once the batch has committed.
    """

    pending: dict[str, Any] = field(default_factory=dict)


#: A unit of work: runs on the writer thread, inside a savepoint of the batch's transaction.
Work = Callable[[sqlite3.Connection, Batch], Any]
_Outcome = tuple[asyncio.Future[Any], Any, BaseException | None]


@dataclass(slots=True)
class _Job:
    work: Work
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


class _BatchLost(Exception):
    """SQLite rolled back the whole transaction on its own."""


def _settle(outcomes: list[_Outcome]) -> None:
    for future, value, error in outcomes:
        if future.done():  # the caller gave up (cancelled, e.g. a stage timeout)
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


class GroupCommitWriter:
    """Owns `conn` (autocommit mode) from now on; closes it when `close` has drained the queue.

    `publish` receives each committed batch's `Batch.pending`, on the writer thread.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        name: str,
        max_batch: int,
        publish: Callable[[dict[str, Any]], None],
    ) -> None:
        self.name = name
        self.max_batch = max(1, max_batch)
        self._conn = conn
        self._publish = publish
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.closed = False
        # Read by /metrics: committed transactions, the work they carried, the last one's size.
        self.batches = 0
        self.batched_jobs = 0
        self.last_batch = 0
        # A daemon thread: an interpreter exiting without close() loses only unacknowledged
        # work (SQLite discards an uncommitted transaction), instead of hanging at exit.
        self._thread = threading.Thread(target=self._run, name=f"sqlite-writer:{name}", daemon=True)
        self._thread.start()

    async def submit(self, work: Work) -> Any:
        """Run `work` in the next batch; return its result once that batch has committed."""
        if self.closed:
            raise RuntimeError(f"the SQLite store {self.name} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.put(_Job(work, loop, future))
        # If the caller is cancelled here the work still happens (it may already be inside a
        # commit); the proxy marks such a record orphaned (DESIGN §8).
        return await future

    def stats(self) -> dict[str, float]:
        return {
            "queue_depth": self._queue.qsize(),
            "batches_total": self.batches,
            "batched_writes_total": self.batched_jobs,
            "last_batch_size": self.last_batch,
        }

    async def close(self) -> None:
        """Finish all queued work, stop the thread and close the connection."""
        if not self.closed:
            self.closed = True
            self._queue.put(None)
        await asyncio.to_thread(self._thread.join)

    def _run(self) -> None:
        try:
            stopping = False
            while not stopping:
                job = self._queue.get()
                if job is None:
                    break
                jobs = [job]
                while len(jobs) < self.max_batch:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stopping = True
                        break
                    jobs.append(more)
                self._write(jobs)
        finally:
            self._conn.close()

    def _write(self, jobs: list[_Job]) -> None:
        conn = self._conn
        batch = Batch()
        outcomes: list[_Outcome] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for job in jobs:
                conn.execute("SAVEPOINT job")
                try:
                    value = job.work(conn, batch)
                except Exception as e:
                    self._undo_job(conn, e)
                    outcomes.append((job.future, None, self._job_error(e)))
                else:
                    conn.execute("RELEASE job")
                    outcomes.append((job.future, value, None))
            conn.execute("COMMIT")
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
            self.batches += 1
            self.batched_jobs += len(jobs)
            self.last_batch = len(jobs)
            try:
                self._publish(batch.pending)
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
        err = StoreError(
            f"writing a batch to {self.name} failed ({type(e).__name__}: {e}); nothing of "
            "this batch was stored"
        )
        err.__cause__ = e
        return err

    @staticmethod
    def _deliver(jobs: list[_Job], outcomes: list[_Outcome]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
        for job, outcome in zip(jobs, outcomes, strict=True):
            by_loop.setdefault(job.loop, []).append(outcome)
        for loop, items in by_loop.items():
            # A closed loop raises RuntimeError: nobody is waiting for these any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, items)
