"""A rollout's events read back in position order even when a compaction put them out of unit
order: with several writers, a merged unit takes its last unit's order, so a writer's unit that
committed after the compaction listed the units (named before another writer's last unit) sorts
before the merged unit holding the rollout's earlier events. The chain verifies, and a writer
continues it after its highest position, not after the last one committed."""

from __future__ import annotations

from pathlib import Path

from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import check_chain
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._gc import load_markers, replace_units
from capture_proxy.sinks.parquet._layout import Marker, live_units, new_unit_name
from tests.support.sink_factories import Session


async def test_events_merged_after_a_later_unit_read_back_in_position_order(
    tmp_path: Path,
) -> None:
    ds = str(tmp_path / "ds")
    session = Session("r")
    sink = ParquetSink(ds)
    for _ in range(2):  # two units, each with its call's `staged` event
        await sink.stage(session.next()[0])
    await sink.close()
    dfs = DatasetFS(ds)
    first, second = live_units(load_markers(dfs))
    # Another writer's unit, named after `second` and committed before a compaction listed the
    # units, which merged it with `first` but did not see `second` (still committing then).
    other = Marker(unit=new_unit_name(second.order)[0], files={}, rows={})
    dfs.put_all({other.rel: other.encode()})
    merged = replace_units(dfs, [first, other], load_markers(dfs), lambda _t, table: table)
    assert merged.order > second.order  # the first call's event now sorts after the second's

    source = ParquetSource(ds)
    events = source.events("r")
    assert [e.position for e in events] == [0, 1]
    assert check_chain(events) == []
    assert source.event_heads()["r"] == (1, events[-1].hash)
    Store(source).verify()
    # A writer opening the dataset continues the chain after position 1.
    sink = ParquetSink(ds)
    await sink.stage(session.next()[0])
    await sink.close()
    source = ParquetSource(ds)
    positions = [e.position for e in source.events("r")]
    assert len(positions) > 2
    assert positions == list(range(len(positions)))
    Store(source).verify()
