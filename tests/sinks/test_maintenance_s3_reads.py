"""Compaction and gc on object storage (moto's S3 server) read each small data file whole in one
GET, fetched ahead concurrently: no HEAD and ranged reads per file, one after another (a few
round trips per file made a run over a few hundred units take minutes on a busy store)."""

from __future__ import annotations

import re
import time
from collections import Counter

from capture_proxy.read.reader import Store
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.registry import compact_store, gc_store
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session, image, stage_parquet

#: A request for a data file in moto's log: its method and key.
_DATA_FILE = re.compile(
    r'"(GET|HEAD) (/\S+/(?:calls|ledger|blobs|attachments)/\S+\.parquet)', re.MULTILINE
)


async def _stage(url: str, rollouts: list[str], calls: int) -> None:
    """`calls` records (each with an image) in each rollout, one unit each."""
    await stage_parquet(url, [Session(r, image=image(r)) for r in rollouts], calls)


def _log_size(moto: MotoS3) -> int:
    time.sleep(0.15)  # moto logs a request once it has answered it
    return moto.log_path.stat().st_size


def _data_reads(moto: MotoS3, since: int) -> Counter[tuple[str, str]]:
    """(method, key) of the data-file requests moto answered after `since` bytes of its log."""
    time.sleep(0.15)
    with moto.log_path.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return Counter((m[1], m[2]) for m in _DATA_FILE.finditer(text))


async def test_compaction_reads_each_data_file_once_in_one_get(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await _stage(url, ["a", "b"], calls=4)
    start = _log_size(moto_s3)
    stats = compact_store(url)
    assert (stats.units_before, stats.units_after) == (8, 1)
    reads = _data_reads(moto_s3, start)
    assert {method for method, _ in reads} == {"GET"}
    # Eight units' calls, ledger, blobs and attachments files, each fetched once.
    assert len(reads) >= 8 * 3
    assert set(reads.values()) == {1}


async def test_gc_reads_each_data_file_in_one_get_per_pass(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await _stage(url, ["a", "b"], calls=3)
    sink = ParquetSink(url, writer_id="w")
    try:
        await sink.put_rollout(RolloutInfo("a", RolloutState.SEALED, False, 0, 10))
    finally:
        await sink.close()
    start = _log_size(moto_s3)
    stats = gc_store(url, older_than_ms=1000, now_ms=int(time.time() * 1000))
    assert stats.rollouts == ["a"]
    reads = _data_reads(moto_s3, start)
    assert {method for method, _ in reads} == {"GET"}
    # Read by the plan's passes (one per table), then again by the rewrite of the units from
    # the first to the last holding rows of "a".
    assert len(reads) >= 6 * 3
    assert max(reads.values()) <= 2
    source = ParquetSource(url)
    assert source.rollouts() == ["b"]
    Store(source).verify()
