"""A proxy's long-lived Parquet reader (``index="units"``) keeps only live rollouts by id: once
a rollout's seal event is indexed, where its rows are is packed under a hash of its id, and a
read of it (resume, manifest, a writer's lookups) is still exact: the same as a reader that
indexes every call."""

from __future__ import annotations

from array import array
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture_proxy.schemas.events import EventDraft, EventKind
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource, _events
from capture_proxy.sinks.parquet._index import Packed, UnitIndex
from capture_proxy.sinks.parquet._keys import RolloutIds
from tests.support.sink_factories import Session


async def _write(ds: str, sealed: list[str], open_: list[str], calls: int) -> None:
    sink = ParquetSink(ds)
    try:
        for r, rollout in enumerate([*sealed, *open_]):
            await sink.put_rollout(RolloutInfo(rollout, RolloutState.OPEN, False, 1_000 + r))
            session = Session(rollout, seed=r)
            for _ in range(calls):
                record, atts = session.next()
                await sink.stage(record, attachments=atts)
        for r, rollout in enumerate(sealed):
            info = RolloutInfo(rollout, RolloutState.OPEN, False, 1_000 + r)
            await sink.put_rollout(replace(info, state=RolloutState.SEALED, sealed_at_ms=5_000 + r))
            await sink.append_event(EventDraft(rollout, EventKind.SEAL, 5_000 + r))
    finally:
        await sink.close()


def _index(source: ParquetSource) -> UnitIndex:
    idx = source._index
    assert isinstance(idx, UnitIndex)
    return idx


def _read(source: ParquetSource, rollout: str) -> tuple[object, ...]:
    return (
        source.rollout_info(rollout),
        # Each record whole: its digests seal every field (schemas/digest.py).
        [(r.call_id, r.seq, r.digest, r.extras_digest) for r in source.calls(rollout)],
        [(r.call_id, r.digest) for r in source.fetch([r.call_id for r in source.calls(rollout)])],
        source.coords([r.call_id for r in source.calls(rollout)]),
        source.summaries(rollout),
        source.events(rollout),
        source.failures(rollout),
    )


async def test_sealed_rollouts_leave_the_units_index_and_read_back_exact(
    tmp_path: Path,
) -> None:
    ds = str(tmp_path / "ds")
    sealed, open_ = [f"s{i}" for i in range(6)], ["o0", "o1"]
    await _write(ds, sealed, open_, calls=3)

    units = ParquetSource(ds, index="units")
    units.refresh()
    idx = _index(units)
    # Only the open rollouts are kept by id; the sealed ones are packed: one entry each for
    # their calls, two for their ledger rows (the sealed header, then the seal event, each in
    # a unit of its own, packs what it found).
    assert set(idx.rollout_units) == set(open_)
    assert set(idx.rollout_ledger) == set(open_)
    assert len(idx.sealed_units) == len(sealed)
    assert len(idx.sealed_ledger) == 2 * len(sealed)

    full = ParquetSource(ds)  # indexes every call and the whole ledger
    for rollout in [*sealed, *open_]:
        assert _read(units, rollout) == _read(full, rollout)
        assert units.rollout_keys(rollout) == full.rollout_keys(rollout)
    assert units.rollouts() == full.rollouts()
    assert units.known().rollouts == set(sealed) | set(open_)
    assert units.event_heads() == full.event_heads()


async def test_a_sealed_rollout_resumes_exact_in_a_writer_that_reopens(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    await _write(ds, ["s0", "s1"], ["o0"], calls=2)
    # A writer opening the store: its reader packs the sealed rollouts, and a late ledger entry
    # of one (an outcome after the seal) finds its calls and chain head in the store.
    sink = ParquetSink(ds)
    try:
        idx = _index(sink._reader)
        assert set(idx.rollout_units) == {"o0"}
        assert idx.calls is None  # no key per call: a parent is found through its rollout
        sealed = ParquetSource(ds).rollout_info("s0")
        assert sink._live.keys("s0").calls == {r.call_id for r in ParquetSource(ds).calls("s0")}
        await sink.put_rollout(replace(sealed, metadata={"late": True}))
    finally:
        await sink.close()
    after = ParquetSource(ds, index="units")
    assert after.rollout_info("s0").metadata == {"late": True}
    assert after.rollout_info("s0").state is RolloutState.SEALED
    assert [e.kind for e in after.events("s0")] == [e.kind for e in ParquetSource(ds).events("s0")]


async def test_a_shared_reader_keeps_no_event_heads_after_its_first_load(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    await _write(ds, ["s0"], ["o0"], calls=1)
    reader = ParquetSource(ds, index="units")  # nobody takes its heads (the proxy's shared one)
    reader.refresh()
    assert _index(reader).heads is not None  # a writer's open would take them now
    await _write(ds, [], ["o1"], calls=1)
    reader.refresh()
    idx = _index(reader)
    assert (idx.heads, idx.headed, idx.called) == (None, None, None)
    # Asked later, they are read from the ledger files.
    assert reader.event_heads() == ParquetSource(ds).event_heads()


async def test_a_reader_without_call_keys_rebuilds_a_call_through_its_rollout(
    tmp_path: Path,
) -> None:
    ds = str(tmp_path / "ds")
    await _write(ds, ["s0"], ["o0"], calls=3)
    full = ParquetSource(ds)
    keyless = ParquetSource(ds, index="units", call_keys=False)
    for rollout in ("s0", "o0"):
        last = full.calls(rollout)[-1].call_id
        assert keyless.full(last, rollout) == full.full(last)
    # Without its rollout, a call it has not read is not found by key.
    keyless.close_reader()
    with pytest.raises(KeyError):
        keyless.full(full.calls("o0")[0].call_id)


@given(
    st.lists(st.lists(st.integers(0, (1 << 63) - 1), max_size=12), max_size=20),
    st.sampled_from([0, 1, 32]),
)
def test_packed_places_read_back_as_added(lists: list[list[int]], low_bits: int) -> None:
    # Any values in any order round-trip (a rollout's places are ascending and close: they
    # take 2-3 bytes each; these are not).
    packed = Packed(low_bits)
    for i, values in enumerate(lists):
        packed.add(f"rollout-{i}", array("Q", values))
    assert len(packed) == len(lists)
    for i, values in enumerate(lists):
        assert packed.find(f"rollout-{i}") == values
    assert packed.find("never-added") == []


def test_packed_places_of_a_rollout_take_a_few_bytes_each() -> None:
    packed = Packed(low_bits=32)
    places = [(1_000 + 7 * i) << 32 | (i % 3) for i in range(100)]
    packed.add("r", places)
    assert packed.find("r") == places
    assert len(packed._values) <= 3 * len(places)


async def _seal_as_the_proxy_does(sink: ParquetSink, rollouts: list[str], first: int) -> None:
    """Calls, then the seal event, then the sealed header, then an outcome (its event, then
    the header): each a unit of its own, in the order `core.lifecycle.seal` and
    `put_outcome` write them."""
    for r, rollout in enumerate(rollouts, first):
        info = RolloutInfo(rollout, RolloutState.OPEN, False, 1_000 + r)
        await sink.put_rollout(info)
        session = Session(rollout, seed=r)
        for _ in range(2):
            record, atts = session.next()
            await sink.stage(record, attachments=atts)
        await sink.append_event(EventDraft(rollout, EventKind.SEAL, 5_000 + r))
        sealed = replace(info, state=RolloutState.SEALED, sealed_at_ms=5_000 + r)
        await sink.put_rollout(sealed)
        body = {"reward": r, "group_id": None, "revision": 1}
        await sink.append_event(EventDraft(rollout, EventKind.OUTCOME, 6_000 + r, body=body))
        await sink.put_rollout(replace(sealed, metadata={"reward": r}))


async def test_a_writer_holds_nothing_of_rollouts_sealed_and_graded_as_the_proxy_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_events, "SEALED_HEADS", 3)
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    try:
        await _seal_as_the_proxy_does(sink, [f"s{i}" for i in range(5)], first=0)
        # No call ids or seq holders of them, and the chain heads of the last few sealed
        # only (each would be held for the life of the proxy, or until 4,096 rollouts pushed
        # it out).
        assert len(sink._live) == 0
        assert len(sink._holders) == 0
        assert sink._events._heads == {}
        assert list(sink._events._sealed) == ["s2", "s3", "s4"]
        # A late ledger entry still continues its chain from the store.
        await sink.put_rollout(
            replace(ParquetSource(ds).rollout_info("s1"), metadata={"late": True})
        )
    finally:
        await sink.close()
    full = ParquetSource(ds)
    assert full.rollout_info("s1").metadata == {"late": True}
    assert [e.position for e in full.events("s1")] == list(range(len(full.events("s1"))))


async def test_the_index_keeps_no_entry_by_id_of_rollouts_sealed_as_the_proxy_seals(
    tmp_path: Path,
) -> None:
    # The proxy writes the seal event first and the sealed header after it, in a later unit
    # (then a grade's header): those rows must not bring a sealed rollout back into the
    # id-keyed dicts, or they grow with every rollout the proxy ever sealed.
    ds = str(tmp_path / "ds")
    await _write(ds, [], ["o0"], calls=2)
    reader = ParquetSource(ds, index="units", call_keys="on_demand")  # as the sink lends it
    reader.refresh()
    counts = []
    for batch in range(3):
        names = [f"s{batch}-{i}" for i in range(4)]
        sink = ParquetSink(ds)
        try:
            await _seal_as_the_proxy_does(sink, names, first=4 * batch)
        finally:
            await sink.close()
        reader.refresh()
        idx = _index(reader)
        counts.append((len(idx.rollout_units), len(idx.rollout_ledger)))
    assert counts == [(1, 1)] * 3  # the open rollout only, however many were sealed
    full = ParquetSource(ds)
    for rollout in full.rollouts():
        assert _read(reader, rollout) == _read(full, rollout)
    assert reader.rollout_info("s2-3").metadata == {"reward": 11}
    assert reader.rollouts() == full.rollouts()


@given(st.lists(st.text(min_size=1, max_size=12), max_size=300), st.integers(0, 300))
def test_rollout_ids_answer_as_a_set_of_them_does(ids: list[str], held_at_open: int) -> None:
    known = RolloutIds(ids[:held_at_open])
    known.update(ids[held_at_open:])
    for rollout_id in ids:
        assert rollout_id in known
    assert "never-stored" not in known or "never-stored" in ids


def test_rollout_ids_take_a_hash_each_once_merged() -> None:
    # A writer's set of every stored rollout id took about 0.1 KB per id.
    known = RolloutIds(f"rollout-{i}" for i in range(50_000))
    known.update(f"new-{i}" for i in range(10_000))
    assert len(known) == 60_000
    assert len(known._pending) < 4_096  # merged into the array as they come
    assert known._sorted.itemsize == 8
    assert all(f"new-{i}" in known for i in range(0, 10_000, 97))
    assert "new-10000" not in known


async def test_a_reopened_writer_holds_the_chain_heads_of_open_rollouts_only(
    tmp_path: Path,
) -> None:
    ds = str(tmp_path / "ds")
    await _write(ds, [], ["o0"], calls=1)
    sink = ParquetSink(ds)
    try:
        await _seal_as_the_proxy_does(sink, [f"s{i}" for i in range(4)], first=0)
    finally:
        await sink.close()
    sink = ParquetSink(ds)  # a restart after weeks: a head per rollout ever sealed, before
    try:
        assert set(sink._events._heads) == {"o0"}
        # A late outcome of a sealed rollout continues its chain from the store.
        body = {"reward": 9, "group_id": None, "revision": 2}
        await sink.append_event(EventDraft("s2", EventKind.OUTCOME, 9_000, body=body))
    finally:
        await sink.close()
    events = ParquetSource(ds).events("s2")
    assert [e.position for e in events] == list(range(len(events)))
    assert [e.prev_hash for e in events[1:]] == [e.hash for e in events[:-1]]
    assert events[-1].kind == "outcome"
