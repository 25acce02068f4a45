"""What is particular to the Parquet sink: its dataset layout and format, group commit into units,
lineage across units and restarts, what a crash or a failing disk leaves behind, the same records
in every sink reading back identical, and compaction. (What every sink must do is in
test_sink_conformance.py.)

This module is also the worker process of its crash and disk-full tests:
``python -m tests.sinks.test_sink_parquet STORE diskfull`` (from the repository root).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import EventDraft, EventKind, claim_event
from capture_proxy.schemas.records import (
    CallStatus,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
    StageResult,
)
from capture_proxy.sinks.base import (
    DuplicateSeq,
    StagingSink,
    StagingSource,
    StoreError,
    StoreFormatError,
)
from capture_proxy.sinks.codec import ROW_FIELDS
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource, _claims
from capture_proxy.sinks.parquet._layout import CALLS_SCHEMA, FORMAT_VERSION
from capture_proxy.sinks.registry import compact_store, open_sink, open_source
from tests.support import ROOT
from tests.support.sink_factories import Session, image

WORKER = "tests.sinks.test_sink_parquet"  # this module, run by `python -m` from ROOT


def markers(ds: Path) -> list[dict[str, Any]]:
    """The dataset's commit markers, in commit order."""
    return [json.loads(p.read_bytes()) for p in sorted((ds / "_commits").glob("*.json"))]


def data_files(ds: Path) -> list[Path]:
    return sorted(
        p for d in ("calls", "blobs", "attachments", "ledger") for p in (ds / d).iterdir()
    )


# -- layout and format ----------------------------------------------------------------------------


async def test_layout_format_file_and_url(tmp_path: Path) -> None:
    ds = tmp_path / "a" / "ds"
    sink = ParquetSink(str(ds))
    assert isinstance(sink, StagingSink)
    assert isinstance(ParquetSource(str(ds)), StagingSource)
    record, atts = Session("lay", image=image("lay")).next()
    res = await sink.stage(record, attachments=atts)
    await sink.close()
    assert res.coords is not None
    assert res.coords.store == f"parquet:///{ds}"
    assert json.loads((ds / "_format.json").read_bytes()) == {
        "format": "capture-proxy-parquet",
        "version": FORMAT_VERSION,
    }
    (m,) = markers(ds)
    assert set(m["files"]) == {"calls", "blobs", "attachments", "ledger"}
    assert m["rows"]["calls"] == 1
    for rel in m["files"].values():
        assert (ds / rel).is_file()
    # The calls file is a plain Parquet table with the codec's columns, readable by any tool.
    table = pq.read_table(ds / m["files"]["calls"])
    assert tuple(table.column_names) == ROW_FIELDS == tuple(CALLS_SCHEMA.names)
    assert table.column("call_id").to_pylist() == ["lay-c0"]
    # Through the store URL too, with the URL reported in coordinates.
    url = f"parquet:///{ds}"
    sink2 = open_sink(url)
    res2 = await sink2.stage(Session("lay2").next()[0])
    await sink2.close()
    assert res2.coords is not None
    assert res2.coords.store == url
    assert open_source(url).coords(["lay2-c0"])[0].store == url


async def test_newer_format_refused_and_left_alone(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    await ParquetSink(str(ds)).close()
    newer = b'{"format": "capture-proxy-parquet", "version": 99}'
    (ds / "_format.json").write_bytes(newer)
    with pytest.raises(StoreFormatError, match=r"format version 99.*upgrade capture-proxy"):
        ParquetSink(str(ds))
    with pytest.raises(StoreFormatError, match="upgrade capture-proxy"):
        ParquetSource(str(ds))
    assert (ds / "_format.json").read_bytes() == newer
    assert list((ds / "_commits").iterdir()) == []


async def test_foreign_or_missing_folder_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(StoreError, match="not a capture-proxy dataset"):
        ParquetSink(str(foreign))
    assert sorted(p.name for p in foreign.iterdir()) == ["cat.jpg"]  # nothing added
    other = tmp_path / "other"
    other.mkdir()
    (other / "_format.json").write_bytes(b'{"format": "delta-lake", "version": 1}')
    with pytest.raises(StoreError, match="delta-lake"):
        ParquetSink(str(other))
    with pytest.raises(StoreError, match="no capture-proxy Parquet dataset"):
        ParquetSource(str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()  # a reader never creates a dataset


async def test_one_writer_at_a_time(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    first = ParquetSink(ds)
    with pytest.raises(StoreError, match="another ParquetSink is writing"):
        ParquetSink(ds)
    reader = ParquetSource(ds)  # readers are never locked out
    await first.stage(Session("w").next()[0])
    assert list(reader.all_keys()) == ["w-c0"]
    await first.close()
    second = ParquetSink(ds)  # the lock went with the first sink
    assert (await second.stage(Session("w").next()[0])).reason == "duplicate_key"
    await second.close()


async def test_unsealed_and_bad_attachment_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    from capture_proxy.schemas.records import Attachment

    sink = ParquetSink(str(tmp_path / "ds"))
    record, atts = Session("bad", image=image("bad")).next()
    with pytest.raises(ValueError, match="sealed"):
        await sink.stage(replace(record, digest=""), attachments=atts)
    ((sha, att),) = atts.items()
    forged = {sha: Attachment(sha, att.media_type, att.data + b"!")}
    result = await sink.stage(record, attachments=forged)
    assert (result.status, result.reason) == (CallStatus.CAPTURE_FAILED, "bad_attachment")
    await sink.close()
    assert list(ParquetSource(str(tmp_path / "ds")).all_keys()) == []
    assert markers(tmp_path / "ds") == []  # a refused record writes no unit at all


# -- group commit ---------------------------------------------------------------------------------


class Gate:
    """A fault hook holding the writer inside its first record until released; then it notes,
    for each later record, how many calls a fresh reader sees committed, and can raise."""

    def __init__(self, ds: Path, raise_on: set[int] | None = None) -> None:
        self.ds = ds
        self.open = threading.Event()
        self.calls = 0
        self.committed_seen: list[int] = []
        self.raise_on = raise_on or set()

    def __call__(self, point: str) -> None:
        if point != "after_record":
            return
        self.calls += 1
        if self.calls == 1:
            assert self.open.wait(10), "test never released the gate"
        self.committed_seen.append(len(list(ParquetSource(str(self.ds)).all_keys())))
        if self.calls in self.raise_on:
            raise RuntimeError(f"injected fault in record {self.calls}")


async def _behind_gate(
    sink: ParquetSink, gate: Gate, records: list[StagedCallRecord]
) -> list[StageResult | BaseException]:
    blocker = asyncio.ensure_future(sink.stage(Session("blocker").next()[0]))
    await asyncio.sleep(0.05)  # the writer thread is now inside the blocker's record
    tasks = [asyncio.ensure_future(sink.stage(r)) for r in records]
    await asyncio.sleep(0)  # every stage() has queued its record
    gate.open.set()
    await blocker
    return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20))


async def test_queued_records_share_one_unit(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    gate = Gate(ds)
    sink = ParquetSink(str(ds), fault=gate)
    results = await _behind_gate(sink, gate, [Session(f"g{i}").next()[0] for i in range(20)])
    await sink.close()
    assert all(isinstance(r, StageResult) and r.status is CallStatus.STAGED for r in results)
    # While the 20 queued records were encoded only the blocker was visible: none of them was
    # acknowledged before all were written, and they landed as one unit.
    assert gate.committed_seen[1:] == [1] * 20
    assert [m["rows"]["calls"] for m in markers(ds)] == [1, 20]


async def test_max_batch_splits_units(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    gate = Gate(ds)
    sink = ParquetSink(str(ds), fault=gate, max_batch=4)
    results = await _behind_gate(sink, gate, [Session(f"m{i}").next()[0] for i in range(10)])
    await sink.close()
    assert all(isinstance(r, StageResult) and r.status is CallStatus.STAGED for r in results)
    assert [m["rows"]["calls"] for m in markers(ds)] == [1, 4, 4, 2]
    assert gate.committed_seen[1:] == [1] * 4 + [5] * 4 + [9] * 2


async def test_faulted_record_fails_alone_and_its_child_is_stored_whole(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    gate = Gate(ds, raise_on={2})  # the first queued record (the parent) fails
    sink = ParquetSink(str(ds), fault=gate)
    s = Session("fam", image=image("fam"))
    parent, patts = s.next()
    child, _ = s.next()
    other, _ = Session("fam2").next()
    blocker = asyncio.ensure_future(sink.stage(Session("blocker").next()[0]))
    await asyncio.sleep(0.05)
    tasks = [
        asyncio.ensure_future(sink.stage(parent, attachments=patts)),
        asyncio.ensure_future(sink.stage(child, attachments=patts)),
        asyncio.ensure_future(sink.stage(other)),
    ]
    await asyncio.sleep(0)
    gate.open.set()
    await blocker
    p_res, c_res, o_res = await asyncio.gather(*tasks, return_exceptions=True)
    await sink.close()
    assert isinstance(p_res, RuntimeError)
    assert "injected fault" in str(p_res)
    assert isinstance(c_res, StageResult)
    assert isinstance(o_res, StageResult)
    assert c_res.status is o_res.status is CallStatus.STAGED
    # The child's parent never landed, so the child holds its whole sequence (and the image,
    # which its failed parent's part had carried).
    assert c_res.coords is not None
    assert (c_res.coords.prev_len, c_res.coords.delta_len) == (0, child.cum_len)
    assert [m["rows"]["calls"] for m in markers(ds)] == [1, 2]
    source = ParquetSource(str(ds))
    assert sorted(source.all_keys()) == sorted(["blocker-c0", child.call_id, other.call_id])
    (got,) = source.fetch([child.call_id])
    assert got.prompt_token_ids == child.prompt_token_ids
    assert [a.data for a in got.attachments] == [image("fam").data]
    Store(source).verify()


async def test_cancelled_stage_still_lands_quietly(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    gate = Gate(ds)
    sink = ParquetSink(str(ds), fault=gate)
    record = Session("late").next()[0]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(sink.stage(record), 0.05)
    gate.open.set()
    await sink.mark_orphaned(record.call_id, "stage_timeout")
    await sink.close()
    source = ParquetSource(str(ds))
    assert source.orphaned() == {record.call_id}
    assert source.calls("late") == []
    assert [r.call_id for r in source.calls("late", include_orphaned=True)] == [record.call_id]
    assert source.rollout_info("late").poisoned


# -- lineage --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_tokens", [0, 4_000_000])
async def test_parent_rebuilt_from_dataset_after_restart(tmp_path: Path, cache_tokens: int) -> None:
    ds = str(tmp_path / "ds")
    s = Session("restart", image=image("restart"))
    sink = ParquetSink(ds, cache_tokens=cache_tokens)
    first = [s.next() for _ in range(3)]
    for r, a in first:
        await sink.stage(r, attachments=a)
    await sink.close()
    sink = ParquetSink(ds, cache_tokens=cache_tokens)  # a new process: empty caches
    later = [s.next() for _ in range(3)]
    results = [await sink.stage(r) for r, _ in later]  # the image is already stored
    dup = await sink.stage(first[0][0])  # keys staged before the restart are still known
    await sink.close()
    assert dup.reason == "duplicate_key"
    for (prev, _), res in zip([first[-1], *later[:-1]], results, strict=True):
        assert res.coords is not None
        assert res.coords.prev_len == prev.cum_len
    source = ParquetSource(ds)
    Store(source).verify()
    assert [r.call_id for r in source.calls("restart")] == [r.call_id for r, _ in first + later]


async def test_reader_sees_commits_made_while_it_is_open(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    s = Session("live")
    await sink.stage(s.next()[0])
    source = ParquetSource(ds)
    assert len(source.calls("live")) == 1
    await sink.stage(s.next()[0])
    await sink.record_failure(
        LedgerEntry("live", "live-x", 9, CallStatus.ABORTED, "client_gone", "bye")
    )
    assert len(source.calls("live")) == 2
    assert [f.call_id for f in source.failures("live")] == ["live-x"]
    await sink.close()


async def test_reader_shared_between_threads_indexes_each_unit_once(tmp_path: Path) -> None:
    # The proxy shares one reader across its worker threads. Unserialized, two refreshes that
    # found the same new units both indexed them: units counted twice, and every later refresh
    # then re-indexed the whole dataset to repair it (the Parquet soak's p99 of 26 s).
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds, max_batch=1)
    source = ParquetSource(ds)
    errors: list[BaseException] = []
    for round_ in range(3):
        for i in range(40):
            await sink.stage(Session(f"t{round_}-{i}").next()[0])
        start = threading.Barrier(8)

        def look(start: threading.Barrier = start) -> None:
            try:
                start.wait()
                source.rollouts()
            except BaseException as e:  # reported below, on the test's thread
                errors.append(e)

        threads = [threading.Thread(target=look) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors
        units = [files["calls"] for files in source._index.units]
        assert len(units) == len(set(units)) == len(markers(Path(ds)))
    assert len(list(source.all_keys())) == 120
    await sink.close()


async def test_row_group_cache_weighs_what_groups_cost(tmp_path: Path) -> None:
    # Small groups cost far more than their Arrow buffers (C++ objects per column): weighed by
    # `nbytes` alone, an 8 MiB cache held 2,000 groups and about 50 MB. Each group now counts
    # at least 4 KiB plus 2 KiB per column, so the count follows the budget.
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds, max_batch=1)
    for i in range(60):
        await sink.stage(Session(f"c{i}").next()[0])
    await sink.close()
    budget = 256 << 10
    source = ParquetSource(ds, cache_bytes=budget)
    assert len(list(source.all_keys())) == 60
    groups = source._groups
    assert groups.weight <= budget
    assert 0 < len(groups._items) <= budget // (4096 + 2 * 2048)


async def test_writer_and_proxy_reader_memory_follows_live_work_not_the_store(
    tmp_path: Path,
) -> None:
    # The Parquet soak grew 7.9 MiB/min: the writer kept every call id, blob key and (rollout,
    # seq), and the proxy's reader an index entry per call and blob. Now the writer keeps the
    # keys of the rollouts in use and a bounded set of recent blob keys, and the proxy's reader
    # (indexed per unit) 16 bytes per call and blob; both still refuse duplicates and resume.
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds, max_live_rollouts=8, max_blob_keys=16)
    reader = open_source(ds, cache_bytes=1 << 20)  # the proxy's long-lived reader
    sessions = [Session(f"r{i}") for i in range(40)]
    firsts = []
    for i, s in enumerate(sessions):
        record = s.next()[0]
        firsts.append(record)
        await sink.stage(record)
        await sink.stage(s.next()[0])
        if i % 2 == 0:  # half sealed (dropped at once), half left open (dropped by recency)
            await sink.put_rollout(RolloutInfo(s.rollout_id, RolloutState.SEALED, False, 1))
            await sink.append_event(EventDraft(s.rollout_id, EventKind.SEAL, 2))
        assert reader.rollout_info(s.rollout_id).rollout_id == s.rollout_id  # as a resume does
        assert len(reader.summaries(s.rollout_id)) == 2
    assert len(sink._live) <= 8
    assert len(sink._shared.blobs) <= 16
    index = reader._index  # type: ignore[attr-defined]
    assert not hasattr(index, "by_rollout")  # no per-call entries: hashes in a bytearray
    assert len(index.calls) == 80
    assert len(reader._refs) <= 8192  # type: ignore[attr-defined]
    # An open rollout that left the writer's memory is read back: a duplicate is still refused.
    again = await sink.stage(firsts[1])
    assert again.status is CallStatus.CAPTURE_FAILED
    assert again.reason == "duplicate_key"
    await sink.stage(sessions[1].next()[0])
    await sink.close()
    assert [s.seq for s in reader.summaries("r1")] == [0, 1, 2]
    assert [r.call_id for r in reader.fetch([firsts[-1].call_id])] == [firsts[-1].call_id]
    Store(ParquetSource(ds)).verify()


async def test_proxy_reader_reads_a_rollouts_ledger_from_its_units_when_asked(
    tmp_path: Path,
) -> None:
    # The proxy's reader replayed every ledger row into memory: since the event log, two
    # events or more per call, the bulk of what the Parquet soak grew by. It now keeps per
    # rollout the units its ledger rows are in, and answers exactly as a full reader does,
    # across units, replaced headers, orphan marks and a compaction that retires units.
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds, max_batch=1)  # one unit per write: a rollout spans many units
    reader = open_source(ds, cache_bytes=1 << 20)  # the proxy's long-lived reader
    sessions = [Session(f"q{i}", image=image(f"q{i}") if i % 2 else None) for i in range(6)]
    staged: list[str] = []

    async def traffic(turns: int) -> None:
        for s in sessions:
            for _ in range(turns):
                record, attachments = s.next()
                await sink.append_event(claim_event(s.rollout_id, record.seq, record.call_id, 1))
                await sink.stage(record, attachments=attachments)
                staged.append(record.call_id)

    await traffic(2)
    await sink.record_failure(
        LedgerEntry("q1", "q1-x", 9, CallStatus.CAPTURE_FAILED, "sink_error", "disk", None, 3)
    )
    orphan = staged[4]  # q2's first call
    await sink.mark_orphaned(orphan, "stage_timeout")
    reader.rollouts()  # indexed so far; the rest arrives after a compaction
    compact_store(ds, grace_s=600)
    await traffic(1)
    for s in sessions[:3]:
        await sink.put_rollout(RolloutInfo(s.rollout_id, RolloutState.SEALED, False, 1, 2))
        await sink.append_event(EventDraft(s.rollout_id, EventKind.SEAL, 2))
    await sink.close()

    full = ParquetSource(ds)
    assert reader.rollouts() == full.rollouts() == [s.rollout_id for s in sessions]
    for s in sessions:
        r = s.rollout_id
        assert reader.rollout_info(r) == full.rollout_info(r)
        assert reader.failures(r) == full.failures(r)
        assert reader.events(r) == full.events(r)
        assert reader.rollout_keys(r) == full.rollout_keys(r)  # type: ignore[attr-defined]
    # Per call a claim and a staged event; q1's failure a ledger event; q0-q2 a seal.
    kinds = [e.kind for e in reader.events("q1")]
    assert kinds == ["claim", "staged"] * 2 + ["ledger", "claim", "staged", "seal"]
    assert [len(reader.events(s.rollout_id)) for s in sessions] == [7, 8, 7, 6, 6, 6]
    assert reader.rollout_info("q0").state is RolloutState.SEALED
    assert reader.rollout_info("q1").poisoned  # its failure
    assert reader.rollout_info("q2").poisoned  # its orphan
    assert reader.orphaned() == full.orphaned() == {orphan}
    assert reader.event_heads() == full.event_heads()  # type: ignore[attr-defined]
    assert reader.known() == full.known()  # type: ignore[attr-defined]
    assert len(reader.known().attachments) == 3  # type: ignore[attr-defined]
    last = staged[-1]  # q5's last call, with q5's image
    (mine,), (theirs,) = reader.fetch([last]), full.fetch([last])
    assert (mine.digest, mine.attachments) == (theirs.digest, theirs.attachments)
    assert [a.sha256 for a in mine.attachments] == [image("q5").sha256]
    with pytest.raises(KeyError):
        reader.rollout_info("never")
    index = reader._index  # type: ignore[attr-defined]
    assert not hasattr(index, "ledger")  # no event, failure or header held: a few ints each
    assert sum(map(len, index.rollout_ledger.values())) <= len(index.units) * 2


async def test_sealing_drops_a_rollout_from_the_writer_without_reading_it_back(
    tmp_path: Path,
) -> None:
    # The proxy seals with the seal event, then a sealed header (`core.lifecycle.seal`). The
    # event drops the rollout's keys when it commits; the header used to read them back from
    # the dataset (and its chain head), and they stayed until `max_live_rollouts` newer
    # rollouts pushed them out: the Parquet soak grew by them, and by the reads. The header now
    # takes the head the seal left (`EventHeads.retire`) and reads nothing.
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    for i in range(6):
        s = Session(f"s{i}")
        await sink.stage(s.next()[0])
        await sink.stage(s.next()[0])
        await sink.append_event(EventDraft(s.rollout_id, EventKind.SEAL, 2))
        assert s.rollout_id not in sink._live
        await sink.put_rollout(RolloutInfo(s.rollout_id, RolloutState.SEALED, False, 1))
        assert s.rollout_id not in sink._live
    assert len(sink._reader._ledger_files) == 0
    assert len(sink._reader._index_groups) == 0
    await sink.close()
    Store(ParquetSource(ds)).verify()


async def test_sealing_drops_a_rollouts_seq_holders_and_full_sequences(
    tmp_path: Path,
) -> None:
    # The writer kept the holder of each of its last 65,536 claimed seqs, about 0.24 KB each
    # (at 100 calls/s that fills for eleven minutes: most of what the 10-minute Parquet soak
    # grew by), and the full sequences of its last 4M tokens of calls (about 19 MB), sealed
    # rollouts' too. A rollout's now go when its seal commits; a late claim of one of its seqs
    # is still refused, naming the call that holds it, from the claim file.
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    firsts: dict[str, str] = {}
    try:
        for i in range(3):
            s = Session(f"h{i}")
            for _ in range(2):
                record = s.next()[0]
                firsts.setdefault(s.rollout_id, record.call_id)
                await sink.append_event(claim_event(s.rollout_id, record.seq, record.call_id, 1))
                await sink.stage(record)
        assert (len(sink._holders), len(sink._fulls)) == (6, 6)
        await sink.append_event(EventDraft("h0", EventKind.SEAL, 2))  # as the proxy seals
        assert (len(sink._holders), len(sink._fulls)) == (4, 4)
        await sink.put_rollout(RolloutInfo("h0", RolloutState.SEALED, False, 1))
        assert (len(sink._holders), len(sink._fulls)) == (4, 4)
        # A sealed header alone (a seal sent again after its event failed) drops them too.
        await sink.put_rollout(RolloutInfo("h1", RolloutState.SEALED, False, 1))
        assert (len(sink._holders), len(sink._fulls)) == (2, 2)
        await sink.append_event(EventDraft("h1", EventKind.SEAL, 2))
        with pytest.raises(
            DuplicateSeq, match=rf"rollout h0 already holds seq 0 \(call {firsts['h0']}\)"
        ):
            await sink.append_event(claim_event("h0", 0, "late", 3))
    finally:
        await sink.close()
    Store(ParquetSource(ds)).verify()


async def test_seq_holders_beyond_the_bound_leave_by_rollout_and_are_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rollouts left open (a driver that never seals) are bounded by count: the least recently
    # used rollouts' holders go, and the store still answers for them.
    monkeypatch.setattr(_claims, "_HOLDERS_KEPT", 4)
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    try:
        for rollout_id in ("o0", "o1", "o2"):
            for seq in (0, 1):
                await sink.append_event(claim_event(rollout_id, seq, f"{rollout_id}-c{seq}", 1))
        assert len(sink._holders) == 4  # o0's two went when o2 came
        with pytest.raises(DuplicateSeq, match=r"rollout o0 already holds seq 1 \(call o0-c1\)"):
            await sink.append_event(claim_event("o0", 1, "late", 2))
        assert len(sink._holders) == 3  # o0 read back pushed o1 out
    finally:
        await sink.close()


_POOL_AFTER_OPEN = """
import asyncio, sys
import pyarrow as pa
from capture_proxy.sinks.parquet import ParquetSink
sink = ParquetSink(sys.argv[1])
print(pa.default_memory_pool().backend_name)
asyncio.run(sink.close())
"""


@pytest.mark.parametrize(("chosen", "expected"), [(None, "system"), ("mimalloc", "mimalloc")])
def test_a_sink_makes_arrow_allocate_with_malloc_unless_the_environment_chose(
    tmp_path: Path, chosen: str | None, expected: str
) -> None:
    # With pyarrow's mimalloc the 4-minute Parquet soak's proxy grew about 4 MiB/min more than
    # with malloc, in steps of tens of MB: mimalloc holds on to what it freed.
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if chosen is not None:
        env["ARROW_DEFAULT_MEMORY_POOL"] = chosen
    out = subprocess.run(
        [sys.executable, "-c", _POOL_AFTER_OPEN, str(tmp_path / "ds")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == expected


async def test_writer_drops_a_sealed_rollouts_event_head_and_reads_it_back(
    tmp_path: Path,
) -> None:
    # The writer held each rollout's last event for as long as it ran; a head now goes when
    # the rollout's seal event commits, and an event after the seal (a late ledger entry)
    # still chains after the stored one.
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    s = Session("late")
    record = s.next()[0]
    await sink.append_event(claim_event("late", 0, record.call_id, 1))
    await sink.stage(record)
    await sink.put_rollout(RolloutInfo("late", RolloutState.SEALED, False, 1, 2))
    await sink.append_event(EventDraft("late", EventKind.SEAL, 2))
    assert "late" not in sink._events._heads
    await sink.record_failure(
        LedgerEntry("late", "late-x", 1, CallStatus.ABORTED, "client_gone", "bye", None, 3)
    )
    await sink.close()
    events = ParquetSource(ds).events("late")
    assert [(e.position, e.kind) for e in events] == [
        (0, "claim"),
        (1, "staged"),
        (2, "seal"),
        (3, "ledger"),
    ]
    assert events[3].prev_hash == events[2].hash
    Store(ParquetSource(ds)).verify()


async def test_damaged_lineage_is_reported_not_looped(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds))
    s = Session("cyc")
    records = [s.next()[0] for _ in range(3)]
    for r in records:
        await sink.stage(r)
    await sink.close()
    # Point the first call at the last one: a cycle only a damaged dataset can hold.
    for f in (ds / "calls").glob("*.parquet"):
        t = pq.read_table(f)
        if t.column("call_id")[0].as_py() == records[0].call_id:
            t = t.set_column(3, "parent_call_id", [[records[2].call_id]])
            t = t.set_column(t.column_names.index("prev_len"), "prev_len", [[1]])
            pq.write_table(t, f)
    problems = Store(ParquetSource(str(ds))).problems()
    assert {p.key for p in problems} == {r.call_id for r in records}
    assert any("loops" in p.message for p in problems)


# -- crashes and failing disks --------------------------------------------------------------------


async def test_uncommitted_files_are_invisible(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds))
    s = Session("torn", image=image("torn"))
    kept, atts = s.next()
    await sink.stage(kept, attachments=atts)
    await sink.close()
    # What a crash mid-commit can leave: a whole unit's files without their marker (killed
    # before the marker), half-written temporary files, a marker still under its temporary name.
    (m,) = markers(ds)
    for table, rel in m["files"].items():
        shutil.copy(ds / rel, ds / table / "09999999999999999999-deadbeef0000.parquet")
        (ds / table / "x.parquet.1234.tmp").write_bytes(b"PAR1\x00half")
    (ds / "_commits" / "09999999999999999999-deadbeef0000.json.99.tmp").write_bytes(b'{"unit"')
    source = ParquetSource(str(ds))
    assert list(source.all_keys()) == [kept.call_id]
    assert Store(source).problems() == []
    # The writer carries on beside them.
    sink = ParquetSink(str(ds))
    nxt, _ = s.next()
    res = await sink.stage(nxt)
    await sink.close()
    assert res.coords is not None
    assert res.coords.prev_len == kept.cum_len
    assert sorted(ParquetSource(str(ds)).all_keys()) == sorted([kept.call_id, nxt.call_id])


async def test_write_failure_retracts_the_unit(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds))
    first, atts = Session("ok", image=image("ok")).next()
    assert (await sink.stage(first, attachments=atts)).status is CallStatus.STAGED
    before = data_files(ds)
    # The ledger folder turns into a file: a unit with ledger rows (a new rollout's header)
    # fails after its calls and blobs files were written under temporary names.
    (ds / "ledger").rename(ds / "ledger.aside")
    (ds / "ledger").write_bytes(b"")
    bad, bad_atts = Session("nope", image=image("nope")).next()
    with pytest.raises(StoreError, match="nothing of this batch was stored") as info:
        await sink.stage(bad, attachments=bad_atts)
    assert str(ds) in str(info.value)
    (ds / "ledger").unlink()
    (ds / "ledger.aside").rename(ds / "ledger")
    assert data_files(ds) == before  # no temporary file, no orphan file
    # The commit marker cannot be written: the unit's files were renamed into place, then
    # retracted.
    (ds / "_commits").rename(ds / "commits.aside")
    (ds / "_commits").write_bytes(b"")
    with pytest.raises(StoreError, match="nothing of this batch was stored"):
        await sink.stage(bad, attachments=bad_atts)
    (ds / "_commits").unlink()
    (ds / "commits.aside").rename(ds / "_commits")
    assert data_files(ds) == before
    # Once the folders are back the same record stages, and only it and the first are there.
    assert (await sink.stage(bad, attachments=bad_atts)).status is CallStatus.STAGED
    await sink.close()
    source = ParquetSource(str(ds))
    assert sorted(source.all_keys()) == sorted([first.call_id, bad.call_id])
    Store(source).verify()


def test_disk_full_fails_the_batch_then_recovers(tmp_path: Path) -> None:
    ds = tmp_path / "full"
    proc = subprocess.run(
        [sys.executable, "-m", WORKER, str(ds), "diskfull"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["staged"] == []
    assert all("nothing of this batch was stored" in e for e in report["errors"]), report
    assert all("File too large" in e for e in report["errors"]), report
    assert report["retried"] == ["staged"] * len(report["keys"])
    source = ParquetSource(str(ds))
    assert sorted(source.all_keys()) == sorted([report["first"], *report["keys"]])
    Store(source).verify()
    assert not list(ds.rglob("*.tmp"))


# The SIGKILL test for this sink is in tests/reliability/test_crash.py (one worker, both sinks).


async def _worker_diskfull(ds: Path) -> None:
    sink = ParquetSink(str(ds))
    first, atts = Session("ok", image=image("ok")).next()
    assert (await sink.stage(first, attachments=atts)).status is CallStatus.STAGED
    # Ignored, exceeding the limit makes write() fail with EFBIG instead of killing us.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    batch = [
        Session(f"full{i}", image=image(f"full{i}")).next(new_prompt=4000, completion=100)
        for i in range(6)
    ]
    outcomes = await asyncio.gather(
        *(sink.stage(r, attachments=a) for r, a in batch), return_exceptions=True
    )
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    retried = await asyncio.gather(*(sink.stage(r, attachments=a) for r, a in batch))
    await sink.close()
    report = {
        "first": first.call_id,
        "keys": [r.call_id for r, _ in batch],
        "errors": [f"{o}" for o in outcomes if isinstance(o, BaseException)],
        "staged": [o.status.value for o in outcomes if isinstance(o, StageResult)],
        "retried": [o.status.value for o in retried],
    }
    print(json.dumps(report), flush=True)


# -- parity ---------------------------------------------------------------------------------------


async def _stage_all(sink: StagingSink, pairs: list[tuple[StagedCallRecord, Any]]) -> list[Any]:
    out = []
    for r, a in pairs:
        res = await (sink.stage(r, attachments=a) if a else sink.stage(r))
        assert res.status is CallStatus.STAGED, res
        out.append(res.coords)
    return out


def _logical(r: StagedCallRecord) -> tuple[Any, ...]:
    return (
        r.call_id,
        r.rollout_id,
        r.seq,
        r.parent_call_id,
        r.retry_of,
        r.weight_version,
        r.model,
        r.finish_reason,
        r.request,
        r.response,
        r.sampling,
        r.extras,
        r.prompt_token_ids.tobytes(),
        r.completion_token_ids.tobytes(),
        r.completion_logprobs.tobytes(),
        r.digest,
        r.extras_digest,
        [(a.sha256, a.media_type, a.data) for a in r.attachments],
    )


async def test_same_records_read_back_identical_from_every_sink(tmp_path: Path) -> None:
    from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource

    pairs: list[tuple[StagedCallRecord, Any]] = []
    a, b = Session("pa", image=image("pa")), Session("pb")
    for turn in range(6):
        pairs.append(a.next(drift_at=30 if turn == 4 else None, extras={"media_spans": [[1, 4]]}))
        pairs.append(b.next(new_image=image("pb-late") if turn == 2 else None))
    memory = MemorySink()
    sqlite_path, ds = str(tmp_path / "s.db"), str(tmp_path / "ds")
    coords = []
    for sink in (memory, SQLiteSink(sqlite_path), ParquetSink(ds)):
        staged = await _stage_all(sink, pairs)
        coords.append([(c.prev_len, c.delta_len, c.cum_len, c.digest) for c in staged])
        await sink.close()
    assert coords[0] == coords[1] == coords[2]
    assert coords[0][8][0] == 30  # the drifted call shares 30 tokens with its parent
    sources: list[StagingSource] = [memory, SQLiteSource(sqlite_path), ParquetSource(ds)]
    keys = [r.call_id for r, _ in pairs]
    reads = [[_logical(r) for r in src.fetch(keys)] for src in sources]
    assert reads[0] == reads[1] == reads[2]
    assert reads[2] == [_logical_in(r, pairs) for r, _ in pairs]
    for rid in ("pa", "pb"):
        calls = [[_logical(r) for r in src.calls(rid)] for src in sources]
        assert calls[0] == calls[1] == calls[2]


def _logical_in(record: StagedCallRecord, pairs: list[tuple[StagedCallRecord, Any]]) -> Any:
    """What a store must read back for `record`: itself, with the images its request names."""
    from dataclasses import replace

    known = {s: a for _, atts in pairs for s, a in atts.items()}
    refs = dict.fromkeys(record.attachment_refs())
    return _logical(replace(record, attachments=tuple(known[s] for s in refs)))


async def _opencode_session(proxy: Any) -> list[str]:
    """An OpenCode-like session: a title call (no tools), three tool turns, a streamed answer.

    Tool arguments are replayed re-serialized (compact JSON), as OpenCode does.
    """
    system = {"role": "system", "content": "You are opencode. " * 40}
    tools = [
        {
            "type": "function",
            "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    user = {"role": "user", "content": "fix the failing test"}
    title = await proxy.chat(
        {"model": "policy", "messages": [user], "reasoning_effort": "low", "max_tokens": 32},
        rollout="sess",
    )
    ids = [title.headers["X-Capture-Call-Id"]]
    messages: list[dict[str, Any]] = [system, user]
    for turn in range(4):
        body: dict[str, Any] = {"model": "policy", "messages": messages, "tools": tools}
        if turn == 3:
            body.update(stream=True, stream_options={"include_usage": True})
        resp = await proxy.chat(body, rollout="sess")
        assert resp.status == 200
        ids.append(resp.headers["X-Capture-Call-Id"])
        if turn == 3:
            assert b"capture-status staged" in await resp.read()
            break
        message = (await resp.json())["choices"][0]["message"]
        calls = message["tool_calls"]
        for c in calls:
            c["function"]["arguments"] = json.dumps(
                json.loads(c["function"]["arguments"]), separators=(",", ":")
            )
        messages = [
            *messages,
            {"role": "assistant", "content": "", "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": f"out {turn}"} for c in calls),
        ]
    return ids


async def test_same_traffic_through_two_proxies_same_token_data(tmp_path: Path) -> None:
    from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource
    from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
    from tests.support.proxy_harness import start_proxy, stop_proxy

    stores = {
        "sqlite": (SQLiteSink, SQLiteSource, str(tmp_path / "capture.db")),
        "parquet": (ParquetSink, ParquetSource, str(tmp_path / "ds")),
    }
    seen: dict[str, Any] = {}
    for kind, (sink_cls, source_cls, location) in stores.items():
        fake = FakeVLLM(seed=3, reparse_tool_arguments=True)
        fake.push(
            Turn("Fixing a test"),
            *(
                Turn(
                    "", reasoning="look", tool_calls=[FakeToolCall("bash", {"command": f"ls {i}"})]
                )
                for i in range(3)
            ),
            Turn("All green now.", reasoning="done"),
        )
        sink = sink_cls(location)
        proxy = await start_proxy(tmp_path / kind, fake=fake, sink=sink)
        try:
            ids = await _opencode_session(proxy)
        finally:
            await stop_proxy(proxy)  # closes the sink
        source = source_cls(location)
        records = source.calls("sess")
        assert [r.call_id for r in records] == ids
        seq_of = {r.call_id: r.seq for r in records}
        traj = Store(source).trajectory("sess", include_open=True)
        seen[kind] = {
            "tokens": [
                (
                    r.seq,
                    r.prompt_token_ids.tobytes(),
                    r.completion_token_ids.tobytes(),
                    r.completion_logprobs.tobytes(),
                    r.finish_reason,
                    seq_of.get(r.parent_call_id or ""),
                )
                for r in records
            ],
            "coords": [(c.prev_len, c.delta_len, c.cum_len) for c in source.coords(ids)],
            "trajectory": (
                traj.token_ids.tobytes(),
                traj.loss_mask.tobytes(),
                traj.logprobs.tobytes(),
                traj.call_index.tobytes(),
                [(s.start, s.end) for s in traj.segments],
                [(seq_of[d.call_id], d.position, d.parent_len, d.prompt_len) for d in traj.drift],
                [seq_of[c] for c in traj.apart],
            ),
        }
    assert seen["sqlite"] == seen["parquet"]
    assert len(seen["parquet"]["tokens"]) == 5
    assert seen["parquet"]["trajectory"][-1] == [0]  # the title call, kept apart
    # The replayed, re-serialized tool calls re-render differently: both stores saw the same
    # drift, at the same positions.
    assert seen["parquet"]["trajectory"][5]


async def test_through_a_pyarrow_filesystem(tmp_path: Path) -> None:
    # A SubTreeFileSystem is not a LocalFileSystem, so this takes the object-storage path:
    # each file is one output stream, no rename, no fsync.
    (tmp_path / "bucket").mkdir()
    fs = pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem())
    sink = ParquetSink("prefix/ds", url="s3://bucket/prefix/ds", filesystem=fs)
    staged = await _stage_all(sink, [Session("obj", image=image("obj")).next()])
    s = Session("obj2")
    staged += await _stage_all(sink, [s.next(), s.next()])
    await sink.close()
    assert staged[0].store == "s3://bucket/prefix/ds"
    assert staged[2].prev_len == staged[1].cum_len
    assert (tmp_path / "bucket" / "prefix" / "ds" / "_format.json").is_file()
    source = ParquetSource("prefix/ds", url="s3://bucket/prefix/ds", filesystem=fs)
    Store(source).verify()
    assert sorted(source.all_keys()) == ["obj-c0", "obj2-c0", "obj2-c1"]


# -- the ledger survives in the dataset -----------------------------------------------------------


async def test_ledger_headers_replay_in_commit_order(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    await sink.put_rollout(RolloutInfo("led", RolloutState.OPEN, False, 10, None, {"v": 1}))
    await sink.stage(Session("led").next()[0])  # known rollout: no implicit header over it
    await sink.put_rollout(RolloutInfo("led", RolloutState.SEALED, False, 10, 20, {"v": 2}))
    await sink.close()
    info = ParquetSource(ds).rollout_info("led")
    assert (info.state, info.sealed_at_ms, dict(info.metadata)) == (
        RolloutState.SEALED,
        20,
        {"v": 2},
    )
    assert ParquetSource(ds).rollouts() == ["led"]


if __name__ == "__main__":
    _store, _mode = Path(sys.argv[1]), sys.argv[2]
    os.environ.setdefault("PYTHONHASHSEED", "0")
    assert _mode == "diskfull", _mode
    asyncio.run(_worker_diskfull(_store))


async def test_units_without_the_schema_2_columns_compact_with_new_ones(tmp_path: Path) -> None:
    """A dataset the previous release wrote (calls files without the schema-2 columns) merges
    with new units: the old rows stay version-1 records and every record still verifies."""
    from capture_proxy.sinks.parquet import compact_store
    from tests.support.sink_factories import ParquetCase

    case = ParquetCase(tmp_path)
    session = Session("mix", schema_version=1)
    for _ in range(2):
        record, _ = session.next()
        assert (await case.sink.stage(record)).status == "staged"
    await case.sink.close()
    case.downgrade()
    case = ParquetCase(tmp_path)
    session.schema_version = 2
    record, _ = session.next()
    assert (await case.sink.stage(record)).status == "staged"
    await case.sink.close()
    stats = compact_store(str(case.location), grace_s=0)
    assert stats.units_after == 1
    with Store(ParquetSource(str(case.location))) as store:
        assert [r.schema_version for r in store.calls("mix", include_open=True)] == [1, 1, 2]
        store.verify()
