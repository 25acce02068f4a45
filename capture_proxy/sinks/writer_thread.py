"""`WriterThread`: the group-commit machinery both real sinks share.

Callers on an event loop `submit` work; one thread takes everything queued (up to `max_batch`,
see `staging_rules.take_batch`) and commits it together: one transaction (SQLite) or one unit
(Parquet), so one fsync answers many concurrent `stage()` calls. With `linger_s` (the Parquet
writer's ``--store-linger``), a batch that comes less than that after the last commit also
takes what arrives until then (`_linger`). Callers are answered only after
the commit, with one ``loop.call_soon_threadsafe`` per batch. A subclass says how a batch is
committed (`_commit`); this class owns the queue, the thread, delivery and the counters that
`/metrics` reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .base import StoreError
from .staging_rules import take_batch

__all__ = ["Job", "Outcome", "WriterThread"]

log = logging.getLogger(__name__)

W = TypeVar("W")
#: (the caller's future, its result, or the error it gets)
Outcome = tuple["asyncio.Future[Any]", Any, "BaseException | None"]


@dataclass(slots=True)
class Job(Generic[W]):
    work: W
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


def _settle(outcomes: list[Outcome]) -> None:
    for future, value, error in outcomes:
        if future.done():  # the caller gave up (cancelled, e.g. a stage timeout)
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


class WriterThread(Generic[W]):
    """Subclasses implement `_commit(jobs)`, which must end with `_deliver(jobs, outcomes)`,
    and may override `_on_exit` (runs on the thread when it stops)."""

    kind = "store"

    def __init__(
        self, *, name: str, max_batch: int, linger_s: float = 0.0, linger_capped: bool = True
    ) -> None:
        self.name = name
        self.max_batch = max(1, max_batch)
        #: After a commit, the next batch waits until this long after it, taking what arrives
        #: meanwhile (`_linger`): fewer, larger commits under load; no wait when idle.
        self.linger_s = max(0.0, linger_s)
        #: Whether the linger is also capped by the last commit's duration (`_linger`).
        self.linger_capped = linger_capped
        self._last_commit = 0.0  # monotonic seconds the last batch's commit ended
        self._last_took = 0.0  # seconds the last batch's commit took
        self._queue: queue.SimpleQueue[Job[W] | None] = queue.SimpleQueue()
        self.closed = False
        # Read by /metrics: committed batches, the writes they carried, the last one's size.
        self.batches = 0
        self.batched_jobs = 0
        self.last_batch = 0
        # Daemon: an interpreter exiting without close() loses only unacknowledged work (an
        # uncommitted transaction or a unit without its marker does not exist).
        self._thread = threading.Thread(
            target=self._run, name=f"{self.kind}-writer:{name}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    async def submit(self, work: W) -> Any:
        """Run `work` in the next batch; return its result once that batch has committed."""
        if self.closed:
            raise RuntimeError(f"the {self.kind} store {self.name} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.put(Job(work, loop, future))
        # A cancelled caller does not stop the work (it may be mid-commit already); the proxy
        # marks such a record orphaned (docs/contract.md).
        return await future

    async def close(self) -> None:
        """Commit everything queued, then stop the thread."""
        if not self.closed:
            self.closed = True
            self._queue.put(None)
        await asyncio.to_thread(self._thread.join)

    def stats(self) -> dict[str, float]:
        return {
            "queue_depth": self._queue.qsize(),
            "batches_total": self.batches,
            "batched_writes_total": self.batched_jobs,
            "last_batch_size": self.last_batch,
        }

    def _run(self) -> None:
        try:
            stopping = False
            while not stopping:
                jobs, stopping = take_batch(self._queue, self.max_batch)
                if not jobs:
                    continue
                if not stopping and self.linger_s:
                    stopping = self._linger(jobs)
                started = time.monotonic()
                try:
                    self._commit(jobs)
                    self._last_took = time.monotonic() - started
                except BaseException as e:  # never leave a caller waiting on a dead thread
                    log.exception("%s: the writer failed", self.name)
                    err = StoreError(f"{self.name}: {e}")
                    self._deliver(jobs, [(j.future, None, err) for j in jobs])
        finally:
            self._on_exit()

    def _linger(self, jobs: list[Job[W]]) -> bool:
        """Add to `jobs` what arrives until the linger after the last commit ended (up to
        `max_batch`), when the batch would commit (`_lingers`); True when the stop sentinel came.

        The linger is `linger_s` or the time the last commit took, whichever is shorter, and
        only while the last commit is young: a write after a quiet spell commits at once, and
        under load the writer waits at most as long as it spent committing, each unit taking
        every write that came meanwhile. So a store whose commits are cheap (a local disk, a
        few milliseconds) adds that little to a call, and one whose commits cost round trips
        (object storage, tens of milliseconds) writes up to about half the units. Without
        `linger_capped`, the whole `linger_s`."""
        linger = min(self.linger_s, self._last_took) if self.linger_capped else self.linger_s
        deadline = self._last_commit + linger
        if time.monotonic() >= deadline or not self._lingers(jobs):
            return False
        while len(jobs) < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                more = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if more is None:
                return True
            jobs.append(more)
        return False

    def _lingers(self, jobs: list[Job[W]]) -> bool:
        """Whether a batch of `jobs` is worth waiting for more (one that commits nothing is
        not): a subclass says."""
        return True

    def _commit(self, jobs: list[Job[W]]) -> None:
        raise NotImplementedError

    def _on_exit(self) -> None:
        pass

    def _committed(self, jobs: list[Job[W]]) -> None:
        self.batches += 1
        self.batched_jobs += len(jobs)
        self.last_batch = len(jobs)
        self._last_commit = time.monotonic()

    @staticmethod
    def _deliver(jobs: list[Job[W]], outcomes: list[Outcome]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
        for job, outcome in zip(jobs, outcomes, strict=True):
            by_loop.setdefault(job.loop, []).append(outcome)
        for loop, items in by_loop.items():
            # A closed loop raises RuntimeError: nobody is waiting for these any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, items)
