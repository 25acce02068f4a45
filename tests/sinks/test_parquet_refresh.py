"""What a long-lived Parquet reader reads when the store's units change under it, on moto's S3
server: a refresh reads the markers it has not read, never again every marker listed (a
compaction's retired markers stay listed for its grace period, and several writers' units land
out of name order), and still sees every committed unit; a writer opening the store reads each
ledger file once."""

from __future__ import annotations

import re
import time

from capture_proxy.sinks.parquet import ParquetSink, ParquetSource, compact_dataset
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._layout import Marker, list_markers, unit_files
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session


async def _stage(url: str, writer: str, rollouts: list[str], calls: int) -> None:
    """`calls` records in each of `rollouts`, one unit each."""
    sink = ParquetSink(url, writer_id=writer)
    try:
        for r, rollout in enumerate(rollouts):
            session = Session(rollout, seed=r)
            for _ in range(calls):
                record, atts = session.next()
                await sink.stage(record, attachments=atts)
    finally:
        await sink.close()


class Gets:
    """GET requests moto has answered for one dataset's objects under `folder`."""

    def __init__(self, moto: MotoS3, url: str, folder: str) -> None:
        prefix = url.removeprefix("s3://")
        self._pattern = re.compile(rf'"(?:\x1b\[[0-9;]*m)*GET /{re.escape(prefix)}/{folder}/')
        self._moto = moto
        self._start = self._count()

    def _count(self) -> int:
        time.sleep(0.15)  # its log line follows the response
        return len(self._pattern.findall(self._moto.log_path.read_text(errors="replace")))

    def since(self) -> int:
        """GETs since this was made, or since the last call."""
        now = self._count()
        n, self._start = now - self._start, now
        return n


def _move_below(src: str, url: str, order: int) -> None:
    """Commit the one unit of dataset `src` into `url`'s dataset as a unit ordered `order`: what
    another writer's unit, named before ours and committed after, looks like to a reader."""
    source, dest = DatasetFS(src), DatasetFS(url)
    (name,) = list_markers(source)
    old = Marker.decode(source.read(f"_commits/{name}.json"))
    unit = f"{order:020d}-{name.split('-', 1)[1]}"
    files = unit_files(unit, old.files)
    dest.put_all({files[t]: source.read(rel) for t, rel in old.files.items()})
    new = Marker(unit, files, dict(old.rows), size=old.size, created_at_ms=old.created_at_ms)
    dest.put_all({new.rel: new.encode()})


async def test_a_unit_landing_below_others_costs_one_marker_read(moto_s3: MotoS3) -> None:
    url, other = moto_s3.url(), moto_s3.url()
    await _stage(url, "a", ["r0", "r1"], calls=3)
    await _stage(other, "b", ["late"], calls=1)
    reader = ParquetSource(url, index="units")
    try:
        assert sorted(reader.rollouts()) == ["r0", "r1"]
        first = int(list_markers(DatasetFS(url))[0].split("-", 1)[0])
        markers = Gets(moto_s3, url, "_commits")
        _move_below(other, url, first + 1)
        # Six units listed; the new one sorts second: only its marker is read.
        assert sorted(reader.rollouts()) == ["late", "r0", "r1"]
        assert markers.since() == 1
        assert len(reader.calls("late")) == 1
        assert len(reader.calls("r0")) == 3
    finally:
        reader.close_reader()


async def test_a_compaction_costs_its_own_marker_not_the_retired_ones(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await _stage(url, "a", ["r0", "r1", "r2"], calls=4)
    reader = ParquetSource(url, index="units")
    try:
        before = {r: [c.staging_key for c in reader.calls(r)] for r in reader.rollouts()}
        markers = Gets(moto_s3, url, "_commits")
        # The retired markers stay listed for the grace period: twelve of them, and the merged
        # unit's. The refresh sees the checkpoint changed and opens from it: it names the merged
        # unit (its marker is not read) and the twelve retired ones.
        stats = compact_dataset(url, target_bytes=256 << 20, grace_s=600, shared_window_s=0)
        assert (stats.units_before, stats.units_after) == (12, 1)
        markers.since()
        after = {r: [c.staging_key for c in reader.calls(r)] for r in reader.rollouts()}
        assert after == before
        assert markers.since() == 0
        # Then a writer's new unit: its marker only, and the reader sees its call.
        await _stage(url, "b", ["r3"], calls=1)
        markers.since()
        assert sorted(reader.rollouts()) == ["r0", "r1", "r2", "r3"]
        assert markers.since() == 1
    finally:
        reader.close_reader()


async def test_a_compaction_deleting_units_at_once_leaves_none_out(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await _stage(url, "a", ["r0", "r1"], calls=2)
    reader = ParquetSource(url, index="units")
    try:
        assert len(reader.calls("r0")) == 2
        await _stage(url, "b", ["r2"], calls=2)
        # Grace 0: the retired units' markers and files are gone when the reader looks again;
        # the merged unit holds every call, and the reader indexes exactly those.
        compact_dataset(url, target_bytes=256 << 20, grace_s=0, shared_window_s=0)
        assert sorted(reader.rollouts()) == ["r0", "r1", "r2"]
        assert [len(reader.calls(r)) for r in ("r0", "r1", "r2")] == [2, 2, 2]
        assert len(list(reader.all_keys())) == 6
    finally:
        reader.close_reader()


async def test_a_writer_opening_the_store_reads_each_ledger_file_once(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await _stage(url, "a", ["r0", "r1"], calls=3)
    dfs = DatasetFS(url)
    markers = [Marker.decode(dfs.read(f"_commits/{n}.json")) for n in list_markers(dfs)]
    ledgers = sum("ledger" in m.files for m in markers)
    full = ParquetSource(url)
    expected = full.event_heads()
    full.close_reader()
    assert set(expected) == {"r0", "r1"}
    reads = Gets(moto_s3, url, "ledger")
    # What a writer reads at open: the index, then the heads it continues each chain from.
    reader = ParquetSource(url, index="units")
    reader.known()
    assert reader.event_heads() == expected
    assert reads.since() == ledgers
    # Taken once: a later call reads the ledger files again (through pyarrow: a GET or two
    # each), and agrees.
    assert reader.event_heads() == expected
    assert reads.since() >= ledgers
    reader.close_reader()
    sink = ParquetSink(url, writer_id="b")
    try:
        assert reads.since() == ledgers
    finally:
        await sink.close()
