"""A Parquet reader shared by a proxy's threads (resumes, the writer's read-ahead, the follower)
on object storage: its reads do not wait for each other, and a refresh indexing other writers'
units does not wait for reads under way (docs/storage.md, "Reads and their concurrency").

The reader is the proxy's kind (``index="units"``, keys on demand) on moto's S3 server. "A read
under way" is a thread holding the reader's index lock shared as every read does while it looks
at the index and loads rows; "a refresh under way" a thread holding its refresh lock as a
refresh does while it lists the store and reads the new units' files."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from capture_proxy.read.reader import Store
from capture_proxy.sinks.parquet import ParquetSource
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session, stage_parquet

#: Long enough for any read here on a loaded machine; the holds below last longer.
READ_S = 30.0


async def _stage(url: str, writer: str, rollout: str, calls: int) -> list[str]:
    """`calls` records of `rollout`, each its own unit; their keys."""
    sessions = [Session(rollout, seed=len(rollout))]
    staged = await stage_parquet(url, sessions, calls, writer_id=writer)
    return [record.staging_key for record in staged]


def _proxy_reader(url: str) -> ParquetSource:
    return ParquetSource(url, index="units", call_keys="on_demand")


@contextmanager
def _held(hold: Iterator[None]) -> Iterator[threading.Event]:
    """Run `hold` (a generator holding something) in a thread until the block ends."""
    entered, release = threading.Event(), threading.Event()

    def run() -> None:
        for _ in hold:
            entered.set()
            release.wait(2 * READ_S)

    thread = threading.Thread(target=run, name="holder")
    thread.start()
    assert entered.wait(READ_S)
    try:
        yield release
    finally:
        release.set()
        thread.join()


def _read_under_way(source: ParquetSource) -> Iterator[None]:
    with source._rw.shared():
        yield


def _refresh_under_way(source: ParquetSource) -> Iterator[None]:
    with source._refreshing:
        yield


async def test_a_rollout_is_read_and_new_units_indexed_while_another_read_is_under_way(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    first = await _stage(url, "w1", "r0", calls=3)
    source = _proxy_reader(url)
    try:
        assert [c.staging_key for c in source.calls("r0")] == first
        with _held(_read_under_way(source)) as release, ThreadPoolExecutor(2) as pool:
            # Another proxy continues: its units are committed while the read is under way.
            later = await _stage(url, "w2", "r1", calls=4)
            # A read of r1 lists the store, indexes its units and reads its records, and a
            # read of r0 runs beside it: neither waits for the read under way.
            r1 = pool.submit(source.calls, "r1")
            r0 = pool.submit(source.fetch, first)
            assert [c.staging_key for c in r1.result(READ_S)] == later
            assert [r.staging_key for r in r0.result(READ_S)] == first
            assert not release.is_set()  # the other read is still under way
        with Store(source) as store:
            store.verify()  # every record digest-checked, the event chains whole
            assert [c.call_id for c in store.calls("r1", include_open=True)] == later
    finally:
        source.close_reader()


async def test_reads_in_a_snapshot_do_not_wait_for_a_refresh_under_way(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    keys = await _stage(url, "w1", "r0", calls=3)
    source = _proxy_reader(url)
    try:
        with source.snapshot():
            with _held(_refresh_under_way(source)) as release:
                calls = source.calls("r0")
                events = source.events("r0")
                summaries = source.summaries("r0")
                assert not release.is_set()  # the refresh is still under way
            assert [c.staging_key for c in calls] == keys
            assert [s.call_id for s in summaries] == keys
            assert [e.call_id for e in events if e.kind == "staged"] == keys
    finally:
        source.close_reader()


async def test_a_read_waits_for_a_refresh_under_way_and_reads_what_was_committed_before_it(
    moto_s3: MotoS3,
) -> None:
    """A read lists the store as of itself at least (what another proxy committed before it is
    read): while a refresh that began earlier is under way, it waits for it, then for one more
    listing if that one began too early."""
    url = moto_s3.url()
    await _stage(url, "w1", "r0", calls=2)
    source = _proxy_reader(url)
    try:
        source.rollouts()
        with ThreadPoolExecutor(1) as pool:
            with _held(_refresh_under_way(source)):
                later = await _stage(url, "w2", "r1", calls=2)
                read = pool.submit(source.calls, "r1")
                assert not read.done()
            assert [c.staging_key for c in read.result(READ_S)] == later
    finally:
        source.close_reader()
