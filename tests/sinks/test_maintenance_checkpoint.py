"""Maintenance at object-store speed, on moto's S3 server (and a local folder where it differs):
the lease is held only to merge, retired units are deleted in bulk after it is released, opens
read the checkpoint of live units and only the markers committed since (never a retired one), a
run whose lease was taken from it is fenced by the checkpoint, and stores without a checkpoint
(written before it existed) still open and compact."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import pytest

from capture_proxy.cli import main
from capture_proxy.read.reader import open_store
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.parquet import LeaseLost, ParquetSink, ParquetSource, maintenance_lease
from capture_proxy.sinks.parquet._checkpoint import CHECKPOINT, Checkpoint
from capture_proxy.sinks.parquet._compact import compact_dataset
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._gc import load_markers, replace_units
from capture_proxy.sinks.parquet._layout import list_markers, live_units
from capture_proxy.sinks.parquet._lease import LEASE
from tests.support.maintenance import compact_all, snapshot
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session, stage_parquet

#: One answered request in moto's log: method, path (with its query).
_REQUEST = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP')


async def _stage(url: str, rollouts: list[str], calls: int) -> None:
    """`calls` records in each rollout, one unit each, every rollout's events included."""
    await stage_parquet(url, [Session(r) for r in rollouts], calls)


def _requests(moto: MotoS3, since: int) -> list[tuple[str, str]]:
    """(method, path) of the requests moto answered after `since` bytes of its log, in order."""
    time.sleep(0.15)  # moto logs a request once it has answered it
    with moto.log_path.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return [(m[1], m[2]) for m in _REQUEST.finditer(text)]


def _markers_read(moto: MotoS3, since: int) -> list[str]:
    return [
        path
        for m, path in _requests(moto, since)
        if m == "GET" and "/_commits/" in path and path.endswith(".json")
    ]


def _log_size(moto: MotoS3) -> int:
    time.sleep(0.15)
    return moto.log_path.stat().st_size


async def test_compaction_deletes_retired_units_in_bulk_after_releasing_the_lease(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    prefix = url.removeprefix("s3://")
    await _stage(url, ["a", "b", "c"], calls=20)
    before = snapshot(url)
    first = compact_all(url, grace_s=600)
    assert (first.units_before, first.units_after, first.deleted_files) == (60, 1, 0)
    start = _log_size(moto_s3)
    second = compact_all(url, grace_s=0)
    # 60 units' data files (calls, blobs, ledger) and markers.
    assert second.deleted_files >= 60 * 3 + 60
    requests = _requests(moto_s3, start)
    assert not [r for r in requests if r[0] == "DELETE"]  # no object deleted one by one
    bulk = [i for i, (m, path) in enumerate(requests) if m == "POST" and "delete" in path]
    # One DeleteObjects for the data files, one for the markers (a thousand keys each at most).
    assert len(bulk) == 2
    lease_writes = [
        i for i, (m, path) in enumerate(requests) if m == "PUT" and path.endswith(f"/{LEASE}")
    ]
    assert lease_writes
    assert lease_writes[-1] < bulk[0]  # released before the first delete
    assert len(list_markers(DatasetFS(url))) == 1
    assert snapshot(url) == before
    assert prefix  # the requests above were all under the test's own prefix


async def test_an_open_reads_the_checkpoint_and_only_the_markers_committed_since(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    await _stage(url, ["a", "b"], calls=15)
    compact_all(url, grace_s=600)  # 30 retired markers stay listed
    await _stage(url, ["c"], calls=3)  # committed after the checkpoint
    start = _log_size(moto_s3)
    source = ParquetSource(url, index="units")
    assert sorted(source.rollouts()) == ["a", "b", "c"]
    markers_read = _markers_read(moto_s3, start)
    assert len(markers_read) == 3  # c's three units; no retired marker, not the merged one
    assert len(source.calls("a")) == 15
    assert [c.seq for c in source.calls("c")] == [0, 1, 2]


async def test_a_long_lived_reader_sees_a_compaction_and_new_units_without_rereading_retired_ones(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    await _stage(url, ["a"], calls=10)
    source = ParquetSource(url, index="units")
    assert source.rollouts() == ["a"]
    compact_all(url, grace_s=600)
    await _stage(url, ["b"], calls=2)
    start = _log_size(moto_s3)
    assert sorted(source.rollouts()) == ["a", "b"]
    markers_read = _markers_read(moto_s3, start)
    # b's two: the checkpoint changed, and names the merged unit (the reader opens from it).
    assert len(markers_read) == 2
    assert len(source.calls("a")) == 10


@pytest.mark.parametrize("where", ["local", "s3"])
async def test_a_run_whose_lease_was_taken_without_its_knowing_is_fenced_by_the_checkpoint(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = str(tmp_path / "ds") if where == "local" else request.getfixturevalue("moto_s3").url()
    await _stage(url, ["a", "b"], calls=4)
    compact_all(url, grace_s=600)  # a checkpoint exists
    await _stage(url, ["c"], calls=3)
    before = snapshot(url)
    dfs = DatasetFS(url)
    with maintenance_lease(url, "compact", dfs=dfs) as stalled:
        run = Checkpoint(dfs, url)
        run.hold(stalled)
        live = run.loaded.live()
        # The holder pauses (a stopped VM) right after its last check; meanwhile its lease is
        # taken from it (here: the lease object removed, so the next run creates it) and that
        # run merges the same units and commits.
        DatasetFS(url).delete(LEASE)
        taker = compact_all(url, grace_s=600)
        assert taker.units_after == 1
        files_before = set(_all_files(url))
        with pytest.raises(LeaseLost, match=r"another maintenance run committed to .*checkpoint"):
            replace_units(
                dfs,
                live,
                run.existing(),
                lambda _t, table: table,
                before_commit=run.gate,
                undo_commit=run.undo,
            )
        assert set(_all_files(url)) == files_before  # its data files removed again
    assert snapshot(url) == before  # every event once: nothing committed twice
    assert len(live_units(load_markers(DatasetFS(url)))) == 1


def _all_files(url: str) -> list[str]:
    dfs = DatasetFS(url)
    return [
        f"{t}/{e.name}" for t in ("calls", "blobs", "ledger", "_commits") for e in dfs.listdir(t)
    ]


async def test_compaction_keeps_each_ledger_row_once_after_a_stalled_run_committed_twice(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    await _stage(url, ["a"], calls=5)
    before = snapshot(url)
    dfs = DatasetFS(url)
    # What a release before fencing could leave: a stalled run and the run that took over both
    # merged the same units, so their rows are live twice (readers replay every event twice).
    markers = load_markers(dfs)
    span = live_units(markers)
    replace_units(dfs, span, markers, lambda _t, table: table)
    replace_units(dfs, span, markers, lambda _t, table: table)
    with open_store(url) as store:
        events = store.source.events("a")
    once = [e for e in before["a"] if e[0] == "event"]
    assert once  # every call claimed its seq: events to duplicate
    assert len(events) == 2 * len(once)
    stats = compact_all(url, grace_s=0)
    assert stats.units_after == 1
    assert snapshot(url) == before
    with open_store(url) as store:
        store.verify()


async def test_a_store_without_a_checkpoint_opens_and_compacts_as_before(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    await _stage(url, ["a", "b"], calls=6)
    dfs = DatasetFS(url)
    # Written as a release before checkpoints writes a compaction: a merged unit retiring the
    # others, no checkpoint object.
    markers = load_markers(dfs)
    replace_units(dfs, live_units(markers)[:8], markers, lambda _t, table: table)
    assert not dfs.exists(CHECKPOINT)
    before = snapshot(url)
    assert sorted(before) == ["a", "b"]
    stats = compact_all(url, grace_s=0)
    assert (stats.units_before, stats.units_after) == (5, 1)
    assert dfs.exists(CHECKPOINT)
    assert snapshot(url) == before


async def test_a_checkpoint_whose_merged_marker_is_missing_is_ignored_then_repaired(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    await _stage(url, ["a"], calls=6)
    before = snapshot(url)
    compact_all(url, grace_s=600)
    dfs = DatasetFS(url)
    (merged,) = live_units(load_markers(dfs))
    # A crash between the checkpoint and the merged unit's marker.
    dfs.delete(merged.rel)
    assert len(live_units(load_markers(dfs))) == 6
    assert snapshot(url) == before  # read from the old units: the same rows
    compact_all(url, grace_s=0)
    assert [m.unit for m in live_units(load_markers(dfs))] == [merged.unit]
    assert snapshot(url) == before


async def test_compact_grace_on_the_command_line(
    moto_s3: MotoS3, capsys: pytest.CaptureFixture[str]
) -> None:
    url = moto_s3.url()
    await _stage(url, ["a"], calls=4)
    assert main(["compact", url]) == 0
    assert "; 0 retired file(s) deleted" in capsys.readouterr().out
    assert len(list_markers(DatasetFS(url))) == 5  # retired markers kept for the grace
    assert main(["compact", url, "--grace", "0s"]) == 0
    deleted = re.search(r"; (\d+) retired file\(s\) deleted", capsys.readouterr().out)
    assert deleted is not None
    assert int(deleted[1]) >= 4 * 3 + 4  # 4 units: their data files and markers
    assert len(list_markers(DatasetFS(url))) == 1
    with pytest.raises(SystemExit) as usage:
        main(["compact", url, "--grace", "soon"])
    assert usage.value.code == 2
    assert "--grace" in capsys.readouterr().err


async def test_a_large_unit_is_kept_and_only_the_units_after_it_are_merged(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "ds")
    await _stage(url, ["a"], calls=6)
    compact_all(url, grace_s=0)
    (large,) = live_units(load_markers(DatasetFS(url)))
    await _stage(url, ["b"], calls=3)
    before = snapshot(url)
    # The merged unit is half the target or more: merging the new units into it would write
    # it again whole.
    stats = compact_dataset(url, target_bytes=large.size * 2, grace_s=0, shared_window_s=0)
    assert (stats.units_before, stats.units_after) == (4, 2)
    first, merged = live_units(load_markers(DatasetFS(url)))
    assert first.unit == large.unit
    assert merged.rows["calls"] == 3
    assert snapshot(url) == before


async def test_two_writers_and_two_maintenance_loops_lose_nothing_and_opens_see_every_ack(
    moto_s3: MotoS3,
) -> None:
    """Two writers stage while two threads compact over and over (grace 3 s: retired units go
    during the load, a reader's open takes less; one run at a time, the other refused) and fresh
    readers open meanwhile: each open sees every call acknowledged before it started, and at the
    end every call reads back. Re-merged units keep the time they were first retired, so the
    clean-up deletes them while compactions keep merging."""
    url = moto_s3.url()
    sinks = [ParquetSink(url, writer_id=f"w{i}") for i in range(2)]
    acked: dict[str, str] = {}
    stop = threading.Event()
    merges: list[int] = []
    deleted: list[int] = []
    refused: list[str] = []
    errors: list[BaseException] = []
    opened: list[tuple[int, int]] = []  # (acknowledged before the open, calls it saw)

    def maintain() -> None:
        while not stop.is_set():
            try:
                stats = compact_all(url, grace_s=3.0)
                merges.append(stats.units_before - stats.units_after)
                deleted.append(stats.deleted_files)
            except StoreError as e:
                if isinstance(e, LeaseLost) or "another maintenance run" not in str(e):
                    errors.append(e)
                    return
                refused.append(str(e))
            except BaseException as e:  # reported by the test, not lost in the thread
                errors.append(e)
                return
            stop.wait(0.05)

    def read() -> None:
        while not stop.is_set():
            before = len(acked)
            try:
                # The source, not `Store`: a call claimed and not yet staged reads as lost
                # there while its writer runs.
                source = ParquetSource(url, index="units")
                seen = sum(len(source.calls(r)) for r in source.rollouts())
            except BaseException as e:
                errors.append(e)
                return
            opened.append((before, seen))

    threads = [threading.Thread(target=maintain) for _ in range(2)]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()

    async def session(sink: ParquetSink, rollout: str, deadline: float) -> None:
        s = Session(rollout)
        while time.monotonic() < deadline:
            record, atts = s.next()
            result = await sink.stage(record, attachments=atts)
            assert result.status.value == "staged", result
            acked[record.call_id] = record.digest

    try:
        deadline = time.monotonic() + 7.0
        await asyncio.gather(
            *(session(sinks[i % 2], f"r{i}", deadline) for i in range(4)),
        )
    finally:
        stop.set()
        for t in threads:
            await asyncio.to_thread(t.join)
        for sink in sinks:
            await sink.close()
    assert errors == []
    assert sum(merges) > 0
    assert sum(deleted) > 0
    assert opened
    assert all(seen >= before for before, seen in opened)
    assert DatasetFS(url).exists(CHECKPOINT)
    with open_store(url) as store:
        got = {
            r.call_id: r.digest
            for rid in store.rollouts()
            for r in store.calls(rid, include_open=True)
        }
        assert got == acked
        store.verify()


async def test_compact_and_gc_wait_for_the_lease_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "ds")
    await _stage(url, ["a"], calls=2)
    with maintenance_lease(url, "compact") as held:
        started = time.monotonic()
        assert main(["gc", url, "--older-than", "1d", "--wait", "1s"]) == 1
        assert time.monotonic() - started >= 1.0
        assert f"compact by {held.holder}" in capsys.readouterr().err
    # Its reservation of the next turn was released when it gave up: a run now takes it.
    with maintenance_lease(url, "gc") as taken:
        taken.check()
    # Released meanwhile: a waiting compaction gets it.
    with maintenance_lease(url, "gc"):
        waiting = threading.Thread(target=main, args=(["compact", url, "--wait", "30s"],))
        waiting.start()
        await asyncio.sleep(0.5)
    waiting.join(30)
    assert "2 unit(s) -> 1" in capsys.readouterr().out


async def test_a_compaction_lists_the_markers_before_it_takes_the_lease(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await _stage(url, ["a", "b"], calls=5)
    start = _log_size(moto_s3)
    compact_all(url, grace_s=600)
    requests = _requests(moto_s3, start)
    lease_writes = [
        i for i, (m, path) in enumerate(requests) if m == "PUT" and path.endswith(f"/{LEASE}")
    ]
    listings = [
        i
        for i, (m, path) in enumerate(requests)
        if m == "GET" and "prefix=" in path and "_commits" in path
    ]
    assert listings
    # None while the lease is held (from its taking to its release).
    assert not [i for i in listings if lease_writes[0] < i < lease_writes[-1]]


async def test_a_reading_made_before_another_run_took_the_lease_is_read_again(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "ds")
    await _stage(url, ["a"], calls=4)
    dfs = DatasetFS(url)
    early = Checkpoint(dfs, url)
    assert len(early.loaded.live()) == 4
    compact_all(url, grace_s=600)  # another run takes the lease and merges meanwhile
    with maintenance_lease(url, "compact", dfs=dfs) as lease:
        early.hold(lease)
        assert len(early.loaded.live()) == 1  # the merged unit, not the four it retired
    unchanged = Checkpoint(dfs, url)
    with maintenance_lease(url, "compact", dfs=dfs) as lease:
        before = unchanged.loaded
        unchanged.hold(lease)
        assert unchanged.loaded is before  # nobody took the lease between: used as read
