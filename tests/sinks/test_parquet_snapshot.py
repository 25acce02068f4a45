"""`ParquetSource.snapshot()`: reads that share one listing of a dataset's units. `verify` reads
every record; on object storage it lists the dataset once, not once per record or rollout (a
LIST request each, paged by a thousand units), and a compaction deleting files under it is
still read through."""

from __future__ import annotations

import time
from pathlib import Path

from capture_proxy.read.reader import Store
from capture_proxy.sinks.parquet import ParquetSource
from capture_proxy.sinks.registry import compact_store
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session, stage_parquet


async def _stage(url: str, rollouts: int, calls: int) -> list[str]:
    """`calls` records in each of `rollouts` rollouts, one unit each; their keys."""
    sessions = [Session(f"r{r}", seed=r) for r in range(rollouts)]
    return [record.staging_key for record in await stage_parquet(url, sessions, calls)]


def _lists(moto: MotoS3) -> int:
    """LIST requests (ListObjectsV2) moto has answered so far."""
    time.sleep(0.15)  # its log line follows the response
    return moto.log_path.read_text(errors="replace").count("list-type=2")


async def test_verify_lists_an_object_store_dataset_once_however_many_records(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    keys = await _stage(url, rollouts=3, calls=4)
    source = ParquetSource(url)
    try:
        assert sorted(source.all_keys()) == sorted(keys)
        before = _lists(moto_s3)
        store = Store(source)
        assert store.problems() == []
        # Twelve records and three rollouts read back: one listing of the commit markers.
        assert _lists(moto_s3) - before == 1
        # Outside a snapshot each read lists again (it sees commits made since the last one).
        source.rollouts()
        source.rollouts()
        assert _lists(moto_s3) - before == 3
    finally:
        source.close_reader()


async def test_a_snapshot_shows_units_committed_during_it_only_after_it(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    first = await _stage(ds, rollouts=1, calls=1)
    source = ParquetSource(ds)
    with source.snapshot():
        assert list(source.all_keys()) == first
        later = await _stage(ds, rollouts=2, calls=1)
        assert list(source.all_keys()) == first
        assert source.rollouts() == ["r0"]
    assert sorted(source.all_keys()) == sorted(later)  # r0's first call, and r1's
    assert source.rollouts() == ["r0", "r1"]


async def test_a_snapshot_given_a_max_age_reads_a_listing_that_young_as_it_is(
    tmp_path: Path,
) -> None:
    ds = str(tmp_path / "ds")
    await _stage(ds, rollouts=1, calls=1)
    source = ParquetSource(ds)
    with source.snapshot(max_age_s=3600):  # never listed yet: lists
        assert source.rollouts() == ["r0"]
    await _stage(ds, rollouts=2, calls=1)
    with source.snapshot(max_age_s=3600):  # listed just now: what that listing showed
        assert source.rollouts() == ["r0"]
    with source.snapshot(max_age_s=0.0):  # the default: a listing of its own
        assert source.rollouts() == ["r0", "r1"]


async def test_a_compaction_deleting_files_under_a_snapshot_is_read_through(
    tmp_path: Path,
) -> None:
    ds = str(tmp_path / "ds")
    keys = await _stage(ds, rollouts=2, calls=3)
    source = ParquetSource(ds)
    with source.snapshot():
        assert sorted(source.all_keys()) == sorted(keys)
        # The units the snapshot listed are merged and their files deleted at once.
        stats = compact_store(ds, grace_s=0)
        assert (stats.units_before, stats.units_after) == (6, 1)
        assert stats.deleted_files > 0
        # The read finds a file gone, re-lists and reads the merged unit.
        assert [r.staging_key for r in source.fetch(keys)] == keys
        assert Store(source).problems() == []
