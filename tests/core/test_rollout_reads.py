"""Rollouts read back from the store (`core/resumes.py`): on threads of their own, a few at a
time, and the re-read of an answered call's rollout (a hand-back, whose rollout is poisoned past
its bound) on threads of its own: it never waits behind resumes under way."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from capture_proxy.core.resumes import READ_THREADS, read_threads, read_with_sink
from capture_proxy.sinks.parquet import ParquetSource
from tests.support.sink_factories import Session, stage_parquet

#: Far more than any read here takes; the resumes under way are held until the test ends.
WAIT_S = 30.0


async def _stage(location: str, rollout: str, calls: int) -> list[str]:
    staged = await stage_parquet(location, [Session(rollout, seed=7)], calls)
    return [record.staging_key for record in staged]


async def test_a_hand_backs_re_read_does_not_wait_behind_resumes_under_way(
    tmp_path: Path,
) -> None:
    location = str(tmp_path / "pq")
    keys = await _stage(location, "back", calls=3)
    source = ParquetSource(location, index="units", call_keys="on_demand")
    release = threading.Event()
    # Every thread resumes run on is taken by a resume under way (a slow store).
    busy = [read_threads().submit(release.wait, WAIT_S) for _ in range(READ_THREADS)]
    try:
        resume = asyncio.ensure_future(read_with_sink(lambda: source, "back", None))
        again = read_with_sink(lambda: source, "back", None, answered=True)
        found = await asyncio.wait_for(again, WAIT_S)
        assert found is not None
        assert (found.next_seq, found.poisoned) == (3, False)
        assert sorted(found.outcomes) == sorted(keys)
        await asyncio.sleep(0.2)
        assert not resume.done()  # a resume waits for a thread of its own pool
    finally:
        release.set()
        for b in busy:
            b.result(WAIT_S)
    resumed = await asyncio.wait_for(resume, WAIT_S)
    assert resumed is not None
    assert sorted(resumed.outcomes) == sorted(keys)
    source.close_reader()
