"""A writer restarted on an object-storage dataset while another writes to it, on moto's S3 server:
the restarted writer's open indexes the units committed since the checkpoint (the other writer's
among them) before it stages anything, so it continues its rollouts at the right seqs and shares
the images stored before the restart; what a trainer then reads is every acknowledged call,
once, verified. And the reads an open makes of a large unit's index columns: two rounds of
requests (`_ranged`), with the same rows, the same page check, and a file gone said as before.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import obstore
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.events import check_chain, claim_event
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.base import StoreDamaged
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.parquet._bounds import MAX_PAGE_BYTES
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._layout import Marker, read_group, read_groups, read_table
from capture_proxy.sinks.parquet._ranged import chunk_ranges, open_columns
from capture_proxy.sinks.parquet._snapshot import fetched_ahead
from tests.support.parquet_bomb import bomb_file
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session, image


async def _stage(sink: ParquetSink, session: Session, acked: dict[str, str]) -> None:
    record, atts = session.next()
    await sink.append_event(claim_event(record.rollout_id, record.seq, record.call_id, 1))
    result = await sink.stage(record, attachments=atts)
    assert result.status is CallStatus.STAGED, result.message
    acked[record.call_id] = record.rollout_id


async def test_a_writer_restarted_under_load_continues_with_nothing_lost_and_no_seq_twice(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    acked: dict[str, str] = {}
    other = ParquetSink(url, writer_id="proxy-a")
    stop = asyncio.Event()

    async def load() -> None:  # the other proxy's sandboxes, all along
        sessions = [Session(f"load-{i}", image=image(f"load-{i}")) for i in range(3)]
        while not stop.is_set():
            for session in sessions:
                await _stage(other, session, acked)

    loading = asyncio.ensure_future(load())
    try:
        first = ParquetSink(url, writer_id="proxy-b")
        mine = Session("mine", image=image("mine"))
        for _ in range(3):
            await _stage(first, mine, acked)
        await first.close()  # the restart: the other writer's units keep landing meanwhile
        at_restart = len(acked)
        await asyncio.sleep(0.5)
        restarted = await asyncio.to_thread(ParquetSink, url, writer_id="proxy-b2")
        assert len(acked) > at_restart
        try:
            # The open indexed the other writer's units committed since: its own rollout goes
            # on after seq 2, referring to the image stored before the restart (no bytes sent).
            last = ParquetSource(url).calls("mine")[-1]
            resumed = Session.resume(last)
            for _ in range(3):
                await _stage(restarted, resumed, acked)
        finally:
            stop.set()
            await loading
            await restarted.close()
    finally:
        stop.set()
        await other.close()
    with open_store(url) as store:
        store.verify()
        keys = set(store.source.all_keys())
        assert keys == set(acked)  # every acknowledged call, nothing more
        for rollout in set(acked.values()):
            seqs = [s.seq for s in store.source.summaries(rollout)]
            assert seqs == list(range(len(seqs)))  # once each, no gap
            assert Counter(acked.values())[rollout] == len(seqs)
            assert check_chain(store.source.events(rollout)) == []
    assert [s.seq for s in ParquetSource(url).summaries("mine")] == [0, 1, 2, 3, 4, 5]


def _put_table(moto_s3: MotoS3, url: str, rel: str, path: Path) -> DatasetFS:
    dfs = DatasetFS(url)
    assert dfs.store is not None
    obstore.put(dfs.store, rel, path.read_bytes())
    return dfs


def _many_groups(tmp_path: Path) -> Path:
    """A file shaped like a compacted unit's: index columns between large ones, many groups."""
    n = 4000
    table = pa.table(
        {
            "call_id": [f"c{i:05d}" for i in range(n)],
            "data": [bytes([i % 251]) * 2048 for i in range(n)],
            "rollout_id": [f"r{i % 7}" for i in range(n)],
        }
    )
    path = tmp_path / "big.parquet"
    pq.write_table(table, path, row_group_size=500, compression="none")
    return path


def test_index_columns_of_a_large_file_are_fetched_at_once_with_the_same_rows(
    moto_s3: MotoS3, tmp_path: Path
) -> None:
    path = _many_groups(tmp_path)
    url = moto_s3.url()
    dfs = _put_table(moto_s3, url, "calls/big.parquet", path)
    before = moto_s3.requests()
    groups = read_groups(dfs, "calls/big.parquet", ["call_id", "rollout_id"])
    ranged = moto_s3.requests() - before
    local = pq.ParquetFile(path)
    assert [g.to_pydict() for g in groups] == [
        local.read_row_group(i, columns=["call_id", "rollout_id"]).to_pydict()
        for i in range(local.num_row_groups)
    ]
    # Read as before (pyarrow's filesystem): a request per page header and chunk, one by one.
    before = moto_s3.requests()
    with dfs.open("calls/big.parquet") as f:
        pf = pq.ParquetFile(f)
        for i in range(pf.num_row_groups):
            pf.read_row_group(i, columns=["call_id", "rollout_id"])
    plain = moto_s3.requests() - before
    # The tail, then each chunk's range at most (fetched together, near ones as one request).
    chunks = chunk_ranges(local.metadata, ["call_id", "rollout_id"])
    assert ranged <= 1 + len(chunks) < plain
    one = read_group(dfs, "calls/big.parquet", 3, ["rollout_id"])
    assert one.to_pydict() == local.read_row_group(3, columns=["rollout_id"]).to_pydict()
    assert read_table(dfs, "calls/big.parquet", ["call_id"]).num_rows == 4000


def test_a_footer_past_the_tail_read_first_is_read_as_it_comes(
    moto_s3: MotoS3, tmp_path: Path
) -> None:
    path = _many_groups(tmp_path)
    dfs = _put_table(moto_s3, moto_s3.url(), "calls/big.parquet", path)
    f = open_columns(dfs, "calls/big.parquet", ["call_id"], footer_bytes=64)
    assert f is not None
    with f:
        got = pq.ParquetFile(f).read(columns=["call_id"], use_threads=False)
    assert got.column(0).to_pylist() == [f"c{i:05d}" for i in range(4000)]


def test_a_bomb_on_object_storage_is_refused_from_the_bytes_fetched(
    moto_s3: MotoS3, tmp_path: Path
) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"key": ["a", "b"], "data": [b"x" * 100, b"y" * 10]}), path)
    bomb_file(path, column="data", page_bytes=MAX_PAGE_BYTES + (8 << 20))
    dfs = _put_table(moto_s3, moto_s3.url(), "blobs/t.parquet", path)
    with pytest.raises(StoreDamaged, match="MAX_PAGE_BYTES"):
        read_groups(dfs, "blobs/t.parquet", ["data"])
    assert read_groups(dfs, "blobs/t.parquet", ["key"])[0].column(0).to_pylist() == ["a", "b"]


def test_a_file_gone_from_object_storage_is_file_not_found(moto_s3: MotoS3) -> None:
    dfs = DatasetFS(moto_s3.url())
    with pytest.raises(FileNotFoundError):
        read_groups(dfs, "calls/gone.parquet", ["call_id"])


def _requests_for(moto_s3: MotoS3, fragment: str) -> list[str]:
    moto_s3.requests()  # waits for the log line of the last answer
    text = moto_s3.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if fragment in line]


async def test_a_writer_open_reads_each_attachments_file_once(moto_s3: MotoS3) -> None:
    """What a writer must know of the attachments (to share them) comes from the open's own
    pass over the units: each attachments file is fetched once, not read a second time."""
    url = moto_s3.url()
    prefix = url.split("/", 3)[3]
    sink = ParquetSink(url, writer_id="proxy-a")
    acked: dict[str, str] = {}
    for i in range(4):
        await _stage(sink, Session(f"r{i}", image=image(f"img-{i}")), acked)
    await sink.close()
    before = len(_requests_for(moto_s3, f"/{prefix}/attachments/"))
    reopened = await asyncio.to_thread(ParquetSink, url, writer_id="proxy-b")
    try:
        reads = _requests_for(moto_s3, f"/{prefix}/attachments/")[before:]
        files = {line.split(f"/{prefix}/", 1)[1].split(" ")[0] for line in reads}
        assert len(files) == 4
        assert len(reads) == len(files)  # one GET each
        # ... and it knows them: a reference alone to one (a resumed session) is staged.
        last = ParquetSource(url).calls("r0")[-1]
        await _stage(reopened, Session.resume(last), acked)
    finally:
        await reopened.close()


def test_a_large_unit_is_a_fetch_chunk_of_its_own_opened_ahead_and_small_units_fetched_whole(
    moto_s3: MotoS3, tmp_path: Path
) -> None:
    """A restarted proxy's open reads a compacted unit's index columns ahead (all its files at
    once) and indexes it while the small units after it are fetched."""
    url = moto_s3.url()
    dfs = _put_table(moto_s3, url, "calls/big.parquet", _many_groups(tmp_path))
    assert dfs.store is not None
    small = [
        Marker(f"{i:020d}-u", {"ledger": f"ledger/{i}.parquet"}, {"ledger": 1}, size=100)
        for i in range(2, 70)
    ]
    for m in small:
        obstore.put(dfs.store, m.files["ledger"], m.unit.encode())
    large = Marker(f"{1:020d}-big", {"calls": "calls/big.parquet"}, {"calls": 9}, size=2 << 20)
    chunks = list(fetched_ahead(dfs, [large, *small], url))
    assert [len(c) for c, _, _ in chunks] == [1, 64, 4]
    assert chunks[0][:2] == ([large], {})
    assert chunks[1][1] == {m.files["ledger"]: m.unit.encode() for m in small[:64]}
    ((rel, (columns, _)),) = chunks[0][2].items()
    assert (rel, columns) == ("calls/big.parquet", frozenset({"call_id", "rollout_id"}))
    # The index read takes the file opened ahead: no request of its own, the same rows.
    dfs.ahead = chunks[0][2]
    before = moto_s3.requests()
    ids = [i for g in read_groups(dfs, rel, ["call_id"]) for i in g.column(0).to_pylist()]
    assert moto_s3.requests() == before
    assert ids == [f"c{i:05d}" for i in range(4000)]
    assert dfs.ahead == {}  # taken once
