"""`WriterThread` hands the jobs of one event-loop pass to its thread together: one wake-up and
one batch for them, in the order they were submitted, each caller answered after the commit."""

from __future__ import annotations

import asyncio
import threading

from capture_proxy.sinks.writer_thread import Job, WriterThread


class _ListWriter(WriterThread[str]):
    """Commits a batch by appending its work to a list (what was committed, batch by batch)."""

    kind = "test"

    def __init__(self) -> None:
        super().__init__(name="list", max_batch=64)
        self.committed: list[list[str]] = []
        self.threads: set[str] = set()

    def _commit(self, jobs: list[Job[str]]) -> None:
        self.threads.add(threading.current_thread().name)
        self.committed.append([j.work for j in jobs])
        self._committed(jobs)
        self._deliver(jobs, [(j.future, f"{j.work}: done", None) for j in jobs])


async def test_jobs_of_one_pass_share_one_batch_in_submission_order() -> None:
    writer = _ListWriter()
    writer.start()
    try:
        results = await asyncio.gather(*(writer.submit(f"job{i}") for i in range(10)))
        assert results == [f"job{i}: done" for i in range(10)]
        assert writer.committed == [[f"job{i}" for i in range(10)]]
        assert writer.stats()["batches_total"] == 1
        assert writer.threads == {"test-writer:list"}
        # A later pass is a later batch: a caller is never held back for company.
        assert await writer.submit("late") == "late: done"
        assert writer.committed[-1] == ["late"]
    finally:
        await writer.close()


async def test_close_commits_jobs_submitted_in_the_same_pass() -> None:
    writer = _ListWriter()
    writer.start()
    job = asyncio.ensure_future(writer.submit("last"))
    await asyncio.sleep(0)  # the job is submitted; its pass has not ended
    assert writer.stats()["queue_depth"] == 1
    await writer.close()
    assert await job == "last: done"
    assert writer.committed == [["last"]]
