"""Where a proxy's long-lived Parquet reader finds a blob, an attachment or (once keyed) a call:
an 8-byte hash per key, and its (unit, row group) once per run of keys with the same place, not
8 more bytes per key (`_index.Locator`). A soak's store gains about a blob per call."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture_proxy.schemas.digest import verify_record
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource, _spill
from capture_proxy.sinks.parquet._index import Locator, UnitIndex
from tests.support.sink_factories import Session


def test_every_key_is_found_at_each_place_it_was_added() -> None:
    loc = Locator()
    places = {}
    for unit in range(300):
        for group in range(1 + unit % 3):
            for k in range(unit % 7):
                key = f"k{unit}-{group}-{k}"
                loc.add(key, unit, group)
                places[key] = (unit, group)
    loc.add("twice", 5, 0)
    loc.add("k3-0-0", 301, 2)  # a second copy, later
    loc.add("twice", 302, 0)
    assert len(loc) == len(places) + 3
    for key, place in places.items():
        if key != "k3-0-0":
            assert list(loc.find(key)) == [place]
    assert list(loc.find("k3-0-0")) == [(3, 0), (301, 2)]
    assert list(loc.find("k3-0-0", newest_first=True)) == [(301, 2), (3, 0)]
    assert list(loc.find("twice")) == [(5, 0), (302, 0)]
    assert list(loc.find("never added")) == []
    assert list(Locator().find("x")) == []


def test_a_locator_holds_about_ten_bytes_a_key_when_ten_share_a_row_group() -> None:
    loc = Locator()
    for unit in range(2_000):
        for k in range(10):
            loc.add(f"{unit}:{k}", unit, 0)
    # 8.2 bytes a key and the arrays' room to grow; 16 and more before.
    assert loc.nbytes() <= 11 * len(loc)
    assert list(loc.find("1999:9")) == [(1999, 0)]


@pytest.mark.parametrize("spill_bytes", [None, 32], ids=["in memory", "in files"])
async def test_a_units_reader_finds_every_blob_of_a_real_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spill_bytes: int | None
) -> None:
    """Also with the index's hashes moved to mapped files past 32 bytes (`_spill`)."""
    if spill_bytes is not None:
        monkeypatch.setattr(_spill, "SPILL_BYTES", spill_bytes)
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    written = {}
    try:
        for r in range(6):
            await sink.put_rollout(RolloutInfo(f"r{r}", RolloutState.OPEN, False, 1_000 + r))
            session = Session(f"r{r}", seed=r)
            for _ in range(4):
                record, atts = session.next()
                await sink.stage(record, attachments=atts)
                written[record.call_id] = record.digest
    finally:
        await sink.close()
    source = ParquetSource(ds, index="units")
    # Each record's messages are blobs: a record read back whole and verified found them all.
    records = source.fetch(list(written))
    for record in records:
        verify_record(record)
    assert {r.call_id: r.digest for r in records} == written
    idx = source._index
    assert isinstance(idx, UnitIndex)
    assert len(idx.blobs) > len(written)
    # One place per blobs row group, not per blob.
    assert len(idx.blobs._places) == sum(1 for files in idx.units if "blobs" in files)
    assert (idx.blobs.files() > 0) == (spill_bytes is not None)
