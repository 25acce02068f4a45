"""A proxy's long-lived Parquet reader holds each unit's name and files packed (about 15 bytes a
unit, `_unit_names`), not as strings and a mapping per unit: a store gains a unit every ten calls
or so for as long as the proxy runs. What it reads through them stays exact."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._index import UnitIndex
from capture_proxy.sinks.parquet._layout import COMMITS_DIR, UnitFiles, list_markers
from capture_proxy.sinks.parquet._unit_names import UnitFileList, UnitNames
from tests.support.sink_factories import Session

STANDARD = [f"{1_780_000_000_000_000_000 + i:020d}-{i:012x}" for i in range(0, 4000, 7)]
OTHERS = [
    "not-a-unit",  # another shape
    f"{2**64:020d}-0123456789ab",  # an order over 64 bits
    "17800000000000000000-0123456789AB",  # upper-case id: kept as written
    "00000000000000000001-0123456789ab",
]


def test_unit_names_give_back_every_name_as_added() -> None:
    names = UnitNames([*STANDARD[:3], *OTHERS, *STANDARD[3:]])
    expected = [*STANDARD[:3], *OTHERS, *STANDARD[3:]]
    assert list(names) == expected
    assert [names[i] for i in range(len(names))] == expected
    assert names[-1] == expected[-1]
    assert names[2:6] == expected[2:6]
    assert names.is_prefix_of(expected)
    assert names.is_prefix_of([*expected, "later"])
    assert not names.is_prefix_of(expected[:-1])
    assert not names.is_prefix_of([*expected[:-1], STANDARD[0]])
    assert UnitNames().is_prefix_of([])
    assert UnitNames().is_prefix_of(["a"])
    assert names.max_order() == max(int(n.split("-")[0]) for n in STANDARD)
    with pytest.raises(IndexError):
        names[len(expected)]


def test_unit_names_cost_fifteen_bytes_or_less_a_unit() -> None:
    many = [f"{1_780_000_000_000_000_000 + i * 997:020d}-{i * 7919:012x}" for i in range(10_000)]
    names = UnitNames(many)
    # As strings in a list they took 0.09 KB each.
    assert names.nbytes() <= 15 * len(many)
    assert list(names) == many


def test_unit_files_are_made_again_from_the_name_and_tables() -> None:
    units = UnitFileList()
    unit = STANDARD[0]
    units.append(unit, UnitFiles(unit, ("calls", "ledger")))
    units.append(STANDARD[1], {"blobs": f"blobs/{STANDARD[1]}.parquet"})
    odd = {"calls": "elsewhere/x.parquet"}  # not named after its unit: kept as it is
    units.append(STANDARD[2], odd)
    assert dict(units[0]) == {"calls": f"calls/{unit}.parquet", "ledger": f"ledger/{unit}.parquet"}
    assert dict(units[1]) == {"blobs": f"blobs/{STANDARD[1]}.parquet"}
    assert units[2] is odd
    assert [dict(f) for f in units] == [dict(units[i]) for i in range(3)]
    assert list(units.names) == STANDARD[:3]


async def _write(ds: str, rollouts: int, calls: int, prefix: str = "r") -> None:
    sink = ParquetSink(ds)
    try:
        for r in range(rollouts):
            info = RolloutInfo(f"{prefix}{r}", RolloutState.OPEN, False, 1_000 + r)
            await sink.put_rollout(info)
            session = Session(info.rollout_id, seed=r)
            for _ in range(calls):
                record, atts = session.next()
                await sink.stage(record, attachments=atts)
            await sink.put_rollout(replace(info, state=RolloutState.SEALED, sealed_at_ms=9_000))
    finally:
        await sink.close()


async def test_a_units_reader_holds_its_units_packed_and_reads_through_them(
    tmp_path: Path,
) -> None:
    ds = str(tmp_path / "ds")
    await _write(ds, rollouts=12, calls=3)
    source = ParquetSource(ds, index="units")
    source.refresh()
    idx = source._index
    assert isinstance(idx, UnitIndex)
    listed = list_markers(DatasetFS(ds))
    assert len(listed) >= 40  # a unit per commit: the sink commits each awaited call
    assert list(idx.units.names) == listed
    assert list(source._listing) == listed
    assert list(source._units) == listed
    # Every file it names is a file of the dataset.
    for files in idx.units:
        for rel in files.values():
            assert (tmp_path / "ds" / rel).is_file()
    held = idx.units.nbytes() + source._listing.nbytes() + source._units.nbytes()
    assert held <= 1024 + 3 * 16 * len(listed)  # was about 0.16 KB a unit
    before = {f"r{r}": [c.call_id for c in source.calls(f"r{r}")] for r in range(12)}
    assert all(len(ids) == 3 for ids in before.values())

    # More units committed: the next refresh appends them to what it holds.
    await _write(ds, rollouts=2, calls=2, prefix="later")
    (tmp_path / "ds" / COMMITS_DIR / "ignored.json.tmp").write_text("")
    source.refresh()
    now = list_markers(DatasetFS(ds))
    assert len(now) > len(listed)
    assert list(idx.units.names) == now == list(source._units)
    assert {f"r{r}": [c.call_id for c in source.calls(f"r{r}")] for r in range(12)} == before
    assert [len(source.calls(f"later{r}")) for r in range(2)] == [2, 2]
    assert source.known().last_order == int(now[-1].split("-")[0])
