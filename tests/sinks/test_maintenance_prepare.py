"""A maintenance run merges before it takes the lease and holds it only to check and commit, on
a local folder and on moto's S3 server: another run finds the lease free while the first merges;
of two runs merging the same units one commits and the other leaves no file behind; a run whose
checkpoint moved without its knowing commits nothing; a run killed after writing its merged
files reads as before, and its files go as leftovers."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.base import CompactStats, StoreError
from capture_proxy.sinks.parquet import LeaseLost, ParquetSink, gc_parquet, maintenance_lease
from capture_proxy.sinks.parquet._checkpoint import CHECKPOINT, Checkpoint, load_markers
from capture_proxy.sinks.parquet._compact import LEFTOVER_AGE_S
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._gc import load_markers as every_marker
from capture_proxy.sinks.parquet._gc import replace_units
from capture_proxy.sinks.parquet._layout import TABLES
from capture_proxy.sinks.parquet._lease import LEASE, NEXT
from tests.support.maintenance import compact_all, snapshot
from tests.support.s3 import MotoS3
from tests.support.sealing import put_sealed
from tests.support.sink_factories import Session, stage_parquet

DAY_MS = 86_400_000


@pytest.fixture(params=["local", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ds")
    else:
        moto: MotoS3 = request.getfixturevalue("moto_s3")
        yield moto.url()


async def _stage(url: str, rollouts: list[str], calls: int) -> None:
    """`calls` records in each rollout, one unit each."""
    await stage_parquet(url, [Session(r) for r in rollouts], calls)


def _data_files(url: str) -> set[str]:
    dfs = DatasetFS(url)
    return {f"{t}/{e.name}" for t in TABLES for e in dfs.listdir(t)}


def _unnamed(url: str) -> set[str]:
    """Data files no marker (live or retired) and no checkpoint entry names: leftovers."""
    dfs = DatasetFS(url)
    named = {rel for m in every_marker(dfs).values() for rel in m.files.values()}
    named |= {rel for m in load_markers(dfs).markers.values() for rel in m.files.values()}
    return _data_files(url) - named


def _merges(url: str) -> int:
    """How many merged units were ever committed (markers that retire units, retired or not)."""
    return sum(1 for m in every_marker(DatasetFS(url)).values() if m.retires)


async def test_another_run_finds_the_lease_free_while_a_compaction_merges(url: str) -> None:
    await _stage(url, ["a", "b"], calls=4)
    before = snapshot(url)
    taken: list[str] = []

    def merged_one(done: int, total: int) -> None:
        if done == 1:  # the first run of units merged (its files written), not committed
            with maintenance_lease(url, "gc") as other:
                other.check()
                taken.append(other.holder)

    stats = compact_all(url, progress=merged_one)
    assert taken  # the other run took the lease and released it while this one merged
    # The lease changed hands since this run read the dataset: it read it again holding the
    # lease, found its units still live, and committed its merge.
    assert (stats.units_before, stats.units_after, stats.merges_dropped) == (8, 1, 0)
    assert stats.lease_held_s > 0
    assert snapshot(url) == before
    assert _unnamed(url) == set()


async def test_a_compaction_writes_its_merged_files_before_it_takes_the_lease(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    await _stage(url, ["a"], calls=5)
    await asyncio.sleep(0.15)  # moto logs a request once it has answered it
    start = moto_s3.log_path.stat().st_size
    compact_all(url)
    await asyncio.sleep(0.15)
    with moto_s3.log_path.open("rb") as f:
        f.seek(start)
        log = f.read().decode(errors="replace").splitlines()
    puts = [line for line in log if '"PUT ' in line]
    lease_writes = [i for i, line in enumerate(puts) if f"/{LEASE} " in line]
    data_writes = [i for i, line in enumerate(puts) if any(f"/{t}/" in line for t in TABLES)]
    marker_writes = [i for i, line in enumerate(puts) if "/_commits/" in line]
    checkpoint_writes = [i for i, line in enumerate(puts) if f"/{CHECKPOINT} " in line]
    assert data_writes
    assert marker_writes
    # Taken after the merged unit's files were written; held for the checkpoint and the marker.
    assert max(data_writes) < lease_writes[0] < checkpoint_writes[0]
    assert checkpoint_writes[-1] < marker_writes[0] < lease_writes[-1]


async def test_a_compaction_that_finds_the_lease_taken_since_its_reading_reads_again_without_it(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    await _stage(url, ["a"], calls=5)
    before = snapshot(url)
    await asyncio.sleep(0.15)
    start = moto_s3.log_path.stat().st_size

    def merged_one(done: int, total: int) -> None:
        if done == 1:
            with maintenance_lease(url, "gc"):
                pass

    stats = compact_all(url, progress=merged_one)
    await asyncio.sleep(0.15)
    with moto_s3.log_path.open("rb") as f:
        f.seek(start)
        log = f.read().decode(errors="replace").splitlines()
    requests = [line for line in log if '"PUT ' in line or '"GET ' in line]
    lease = [i for i, line in enumerate(requests) if '"PUT ' in line and f"/{LEASE} " in line]
    listings = [i for i, line in enumerate(requests) if '"GET ' in line and "prefix=" in line]
    # The other run's take and release; this run's first take (the lease changed hands since
    # its reading) and release; its second take and release, around the commit.
    assert len(lease) == 6
    held = [(lease[2], lease[3]), (lease[4], lease[5])]
    assert not [i for i in listings for a, b in held if a < i < b]  # none holding the lease
    assert [i for i in listings if lease[3] < i < lease[4]]  # read again between the two
    assert (stats.units_after, stats.merges_dropped) == (1, 0)
    assert snapshot(url) == before


async def test_of_two_compactions_of_the_same_units_one_commits_and_the_other_deletes_its_files(
    url: str,
) -> None:
    await _stage(url, ["a", "b"], calls=3)
    before = snapshot(url)
    other: list[CompactStats] = []

    def merged_one(done: int, total: int) -> None:
        if done == 1:  # another run merges the same units and commits first
            other.append(compact_all(url))

    stats = compact_all(url, progress=merged_one)
    assert other[0].units_after == 1
    # This run found, holding the lease, that its units were merged: it committed nothing.
    assert stats.merges_dropped == 1
    assert stats.units_before == stats.units_after == 1
    assert _merges(url) == 1
    assert _unnamed(url) == set()  # its merged files were deleted
    assert snapshot(url) == before


async def test_two_compactions_at_once_commit_one_merge_and_leave_no_file_behind(
    url: str,
) -> None:
    await _stage(url, ["a", "b"], calls=3)
    before = snapshot(url)
    start = threading.Barrier(2)
    results: list[CompactStats | StoreError] = []

    def run() -> None:
        start.wait()
        try:
            results.append(compact_all(url))
        except StoreError as e:  # refused: the other holds the lease
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    refused = [r for r in results if isinstance(r, StoreError)]
    assert not [r for r in refused if isinstance(r, LeaseLost)]
    assert all("another maintenance run" in str(r) for r in refused)
    assert _merges(url) == 1
    assert _unnamed(url) == set()
    assert snapshot(url) == before


def _replace_lease(url: str, body: bytes) -> None:
    DatasetFS(url).put_all({LEASE: body})


async def test_a_compaction_whose_checkpoint_moved_without_its_knowing_commits_nothing(
    url: str,
) -> None:
    await _stage(url, ["a", "b"], calls=3)
    before = snapshot(url)
    with maintenance_lease(url, "gc"):
        pass  # a released lease object, as after any run
    released = DatasetFS(url).read(LEASE)

    def merged_one(done: int, total: int) -> None:
        if done == 1:
            # Another run commits a merge of the same units, and the lease object ends up as
            # this run saw it (the same bytes: the same etag), so this run uses its reading:
            # the compare-and-swap of the checkpoint is what stops it.
            compact_all(url)
            _replace_lease(url, released)

    with pytest.raises(LeaseLost, match=r"another maintenance run committed to .*live\.json"):
        compact_all(url, progress=merged_one)
    assert _merges(url) == 1
    assert _unnamed(url) == set()  # its merged files deleted
    assert snapshot(url) == before
    with maintenance_lease(url, "compact") as lease:  # released on the way out
        lease.check()


#: A compaction killed after its first merge was written: stops in its progress callback.
_KILLED = """
import sys, time
from capture_proxy.sinks.parquet._compact import compact_dataset

def progress(done, total):
    if done == 1:
        print("merged", flush=True)
        time.sleep(600)

compact_dataset(sys.argv[1], target_bytes=int(sys.argv[2]), grace_s=600, shared_window_s=0,
                progress=progress)
"""


def _kill_after_its_first_merge(url: str, target_bytes: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, url, str(target_bytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "merged"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


async def test_a_compaction_killed_after_writing_its_merge_leaves_the_store_as_before(
    url: str,
) -> None:
    await _stage(url, ["a", "b"], calls=3)
    await _stage(url, ["c"], calls=1)
    before = snapshot(url)
    files = _data_files(url)
    size = sum(m.size for m in load_markers(DatasetFS(url)).live())
    # Two runs of units (the target splits them): killed between the first and the second.
    _kill_after_its_first_merge(url, size // 2 + 1)
    leftovers = _data_files(url) - files
    assert leftovers  # the merged unit's files, named by no marker
    assert _unnamed(url) == leftovers
    assert _merges(url) == 0
    assert snapshot(url) == before
    # It never took the lease: the next run takes it at once, merges, and keeps the leftovers
    # (younger than LEFTOVER_AGE_S, they might be a commit in progress).
    stats = compact_all(url, grace_s=0)
    assert stats.units_after == 1
    assert _unnamed(url) == leftovers
    assert snapshot(url) == before
    if url.startswith("s3://"):
        return  # an object's age cannot be set on S3: the deletion is shown on a folder
    old = time.time() - LEFTOVER_AGE_S - 60
    for rel in leftovers:
        os.utime(Path(url) / rel, (old, old))
    stats = compact_all(url, grace_s=0)
    assert stats.deleted_files >= len(leftovers)
    assert _unnamed(url) == set()
    assert snapshot(url) == before


async def test_a_gc_whose_units_were_merged_meanwhile_reads_again_and_removes_the_rollout(
    url: str,
) -> None:
    await _stage(url, ["a", "b"], calls=3)
    sink = ParquetSink(url, writer_id="w")
    await put_sealed(sink, RolloutInfo("a", RolloutState.SEALED, False, 0, 10))
    await sink.close()
    kept = snapshot(url)["b"]
    merged: list[CompactStats] = []

    def reading(done: int, total: int) -> None:
        if not merged:  # while gc reads the units, a compaction merges them all
            merged.append(compact_all(url))

    stats = gc_parquet(
        url, older_than_ms=DAY_MS, now_ms=10 + DAY_MS + 1, shared_window_s=0, progress=reading
    )
    assert merged[0].units_after == 1
    assert stats.rollouts == ["a"]
    assert snapshot(url) == {"b": kept}
    assert _merges(url) == 2  # the compaction's, then gc's rewrite of it
    assert _unnamed(url) == set()  # gc's first rewrite, of units merged since, deleted


async def test_a_gc_whose_units_are_merged_at_every_reading_stops_saying_so_and_leaves_no_file(
    url: str,
) -> None:
    await _stage(url, ["a", "b"], calls=2)
    sink = ParquetSink(url, writer_id="w")
    await put_sealed(sink, RolloutInfo("a", RolloutState.SEALED, False, 0, 10))
    await sink.close()
    readings: list[int] = []

    def reading(done: int, total: int) -> None:
        if done == 1:  # each time gc starts reading: new units, and a compaction of them all
            readings.append(total)
            asyncio.run(_stage(url, [f"new{len(readings)}"], calls=1))
            compact_all(url)

    with pytest.raises(StoreError) as stopped:
        await asyncio.to_thread(
            gc_parquet,
            url,
            older_than_ms=DAY_MS,
            now_ms=10 + DAY_MS + 1,
            shared_window_s=0,
            progress=reading,
        )
    assert str(stopped.value) == (
        f"gc of {url} stopped: other maintenance runs merged the units it was rewriting, 3 "
        "times while it read them; nothing was committed, run it again"
    )
    assert len(readings) == 3
    assert sorted(snapshot(url)) == ["a", "b", "new1", "new2", "new3"]  # nothing removed
    assert _unnamed(url) == set()  # each rewrite's files deleted


def _wait_for(exists: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _merge_while_a_compaction_waits(url: str) -> tuple[int, str]:
    """Run ``capture-proxy compact --wait`` while this test holds the lease, and merge its units
    and commit once it waits (it has merged them too); its exit status and output."""
    dfs = DatasetFS(url)
    with maintenance_lease(url, "gc", dfs=dfs) as lease:
        # It reads and merges, then waits for the lease, first in line (its reservation).
        proc = subprocess.Popen(
            [sys.executable, "-m", "capture_proxy", "compact", url, "--wait", "60s"],
            stdout=subprocess.PIPE,
            text=True,
        )
        _wait_for(lambda: dfs.exists(NEXT) and b'"released":false' in dfs.read(NEXT))
        run = Checkpoint(dfs, url)
        run.hold(lease)
        replace_units(
            dfs,
            run.loaded.live(),
            run.existing(),
            lambda _t, table: table,
            before_commit=run.gate,
            undo_commit=run.undo,
        )
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


async def test_compact_on_the_command_line_says_which_merges_another_run_committed_first(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "ds")
    await _stage(url, ["a", "b"], calls=3)
    before = snapshot(url)
    returncode, out = _merge_while_a_compaction_waits(url)
    assert returncode == 0
    lines = out.splitlines()
    assert lines[0].startswith("1 unit(s) -> 1, ")
    assert re.search(r"; the lease held \d+\.\d\d s$", lines[0])
    assert lines[1] == (
        "1 merge(s) not committed: another maintenance run merged some of their units first "
        "(their files are deleted; the next run merges what is left)"
    )
    assert _merges(url) == 1
    assert _unnamed(url) == set()
    assert snapshot(url) == before
