"""Arrow engines read a Parquet dataset's live files (`live_files`), on a local folder and on
moto's S3 server: the recipes of docs/storage.md ("Reading the files with Arrow engines"), as
written there. A raw glob would also read a crashed commit's file and the units a compaction or
gc retired; the snapshot reads each live call once, and none of a removed rollout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import obstore
import obstore.exceptions
import polars as pl
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from obstore.store import from_url

from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.parquet import (
    ParquetSink,
    ParquetSource,
    compact_dataset,
    gc_parquet,
    live_files,
)
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session

DAY_MS = 86_400_000


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ds")
    else:
        moto: MotoS3 = request.getfixturevalue("moto_s3")
        yield moto.url()


async def _store(location: str) -> dict[str, int]:
    """Rollouts `a` (3 calls), `b` (2), and `old` (sealed a week ago, removed by gc), with a
    compaction between and a crashed commit's file left behind; returns calls per rollout kept."""
    sink = ParquetSink(location)
    sessions = {r: Session(r) for r in ("a", "b", "old")}
    for rollout, n in (("a", 2), ("b", 1), ("old", 2)):
        for _ in range(n):
            await sink.stage(sessions[rollout].next()[0])
    week_ago = int(time.time() * 1000) - 7 * DAY_MS
    await sink.put_rollout(RolloutInfo("old", RolloutState.SEALED, False, week_ago, week_ago))
    await sink.close()
    compact_dataset(location, target_bytes=1 << 30, grace_s=600)
    sink = ParquetSink(location)
    for rollout in ("a", "b"):
        await sink.stage(sessions[rollout].next()[0])
    await sink.close()
    gc_parquet(location, older_than_ms=DAY_MS, now_ms=int(time.time() * 1000))
    # A commit that crashed before its marker: a data file no marker names.
    fs, root = pafs.FileSystem.from_uri(location) if "://" in location else (None, location)
    one = live_files(location).dataset("calls").to_table()
    path = f"{root}/calls/00000000000000000001-crashed00000.parquet"
    if fs is None:
        pq.write_table(one, path)
    else:
        with fs.open_output_stream(path) as out:
            pq.write_table(one, out)
    return {"a": 3, "b": 2}


async def test_the_snapshot_lists_each_live_call_once(location: str) -> None:
    kept = await _store(location)
    snap = live_files(location)
    assert len(snap.urls("calls")) == len(snap.paths("calls")) >= 2
    assert all(u.endswith(".parquet") and "/calls/" in u for u in snap.urls("calls"))
    # What a glob of calls/ would read: retired units, the crashed file, the removed rollout.
    everything = pq.read_table(
        snap.paths("calls")[0].rsplit("/", 1)[0],
        filesystem=snap.filesystem,
        columns=["rollout_id"],
    )
    assert everything.num_rows > sum(kept.values())
    assert "old" in everything.column("rollout_id").to_pylist()

    # pyarrow.dataset
    calls = snap.dataset("calls")
    table = calls.to_table(columns=["rollout_id", "seq", "call_id"])
    per_rollout = table.group_by("rollout_id").aggregate([("call_id", "count")])
    assert dict(zip(*per_rollout.to_pydict().values(), strict=True)) == kept
    assert table.num_rows == len(set(table.column("call_id").to_pylist()))

    # DuckDB, over the same pyarrow dataset (no httpfs extension needed)
    rows = duckdb.execute(
        "SELECT rollout_id, count(*) AS calls, max(seq) AS last_seq "
        "FROM calls GROUP BY rollout_id ORDER BY rollout_id"
    ).fetchall()
    assert rows == [("a", 3, 2), ("b", 2, 1)]

    # Polars, from the URLs (S3 credentials and endpoint from the AWS_* environment)
    frame = (
        pl.scan_parquet(snap.urls("calls"))
        .group_by("rollout_id")
        .agg(pl.len().alias("calls"), pl.col("cum_len").max().alias("tokens"))
        .sort("rollout_id")
        .collect()
    )
    assert frame["rollout_id"].to_list() == ["a", "b"]
    assert frame["calls"].to_list() == [3, 2]
    assert all(t > 0 for t in frame["tokens"].to_list())

    # The ledger's live rows hold each rollout's latest header once replayed in commit order.
    ledger = snap.dataset("ledger").to_table(columns=["kind", "rollout_id"]).to_pylist()
    assert {r["rollout_id"] for r in ledger if r["kind"] == "rollout"} == {"a", "b"}


def test_no_dataset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no capture-proxy Parquet dataset at"):
        live_files(str(tmp_path / "nothing"))


async def test_reads_fall_back_to_pyarrow_where_obstore_cannot_connect(
    moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = moto_s3.url()
    kept = await _store(url)
    # obstore refuses a plain-HTTP endpoint without AWS_ALLOW_HTTP; pyarrow does not need it
    # (as with credentials only pyarrow finds, in a profile file).
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    with pytest.raises(obstore.exceptions.BaseError):
        obstore.get(from_url(url), "_format.json")
    assert ParquetSource(url).rollouts() == sorted(kept)
    assert [len(ParquetSource(url).calls(r)) for r in sorted(kept)] == [3, 2]
    assert len(live_files(url).paths("calls")) >= 2
