"""`verify` and the trainer-facing status hold every claimed seq to account, through each store's
own files: a record, a ledger row or a whole unit removed behind the store's back is reported
(naming the rollout and the event), and a rollout whose failure was deleted stays poisoned."""

from __future__ import annotations

import io
import sqlite3
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.read.reader import Store, StoreCorrupted
from capture_proxy.schemas.events import EventDraft, EventKind, claim_event
from capture_proxy.schemas.records import (
    CallStatus,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from capture_proxy.sinks.base import StagingSink
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource
from tests.support.sink_factories import Session


def _problems(store: Store) -> list[tuple[str, str]]:
    with pytest.raises(StoreCorrupted) as e:
        store.verify()
    return [(p.key, p.message) for p in e.value.problems]


def _inspect_verify(target: str) -> tuple[int, str]:
    out = io.StringIO()
    return inspect_main([target, "--verify"], stdout=out), out.getvalue()


async def _rollout(sink: StagingSink) -> tuple[StagedCallRecord, StagedCallRecord]:
    """Two staged calls, then a capture failure, then the seal: events 0-6 of rollout ep."""
    session = Session("ep")
    first, _ = session.next()
    second, _ = session.next()
    for record in (first, second):
        await sink.append_event(claim_event("ep", record.seq, record.call_id, 1))
        assert (await sink.stage(record)).status == "staged"
    await sink.append_event(claim_event("ep", 2, "x2", 2))
    await sink.record_failure(
        LedgerEntry("ep", "x2", 2, CallStatus.CAPTURE_FAILED, "stage_timeout", "slow", None, 3)
    )
    # Sealed as the proxy seals: the header, then the seal event.
    await sink.put_rollout(RolloutInfo("ep", RolloutState.SEALED, False, 0, 4))
    await sink.append_event(EventDraft("ep", EventKind.SEAL, 4))
    await sink.close()
    return first, second


async def test_a_deleted_last_record_fails_verify_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    _, second = await _rollout(SQLiteSink(str(path)))
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM calls WHERE call_id = ?", (second.call_id,))
    db.close()
    with Store(SQLiteSource(str(path))) as store:
        assert _problems(store) == [
            (
                "rollout:ep",
                f"seq 1 (call {second.call_id}, event 3) was staged; its record is missing",
            )
        ]
        lost = [n for n in store.status("ep").not_staged if n.status == "lost_in_crash"]
        assert [(n.seq, n.call_id) for n in lost] == [(1, second.call_id)]
    code, text = _inspect_verify(str(path))
    assert code == 1
    assert f"seq 1 (call {second.call_id}, event 3) was staged; its record is missing" in text


async def test_a_deleted_ledger_row_fails_verify_and_the_rollout_stays_poisoned_sqlite(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.db"
    await _rollout(SQLiteSink(str(path)))
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM failures WHERE call_id = 'x2'")
    db.close()
    with Store(SQLiteSource(str(path))) as store:
        assert _problems(store) == [
            (
                "rollout:ep",
                "seq 2 (call x2, event 5) is in the event log as capture_failed "
                "(stage_timeout); its ledger entry is missing or changed",
            )
        ]
        status = store.status("ep")
        assert status.poisoned  # the ledger row is gone; the event log still says so
        assert [(n.seq, n.status) for n in status.not_staged] == [(2, "capture_failed")]
    # Deleting its event as well breaks the chain there.
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM events WHERE rollout_id = 'ep' AND kind = 'ledger'")
    db.close()
    with Store(SQLiteSource(str(path))) as store:
        assert _problems(store) == [
            (
                "rollout:ep",
                "event log broken at position 5: event 5 is missing (the next stored event "
                "is at position 6)",
            )
        ]
        assert store.status("ep").poisoned  # the claim is left: lost_in_crash


async def test_a_deleted_ledger_unit_fails_verify_parquet(tmp_path: Path) -> None:
    location = tmp_path / "ds"
    await _rollout(ParquetSink(str(location)))
    # The unit that committed the ledger entry (its event, and the call's claim event before
    # it): remove it, marker and files.
    (unit,) = [
        m
        for m in (location / "_commits").glob("*.json")
        if (location / "ledger" / f"{m.stem}.parquet").exists()
        and "failure"
        in pq.read_table(location / "ledger" / f"{m.stem}.parquet")["kind"].to_pylist()
    ]
    for table in ("calls", "blobs", "attachments", "ledger"):
        (location / table / f"{unit.stem}.parquet").unlink(missing_ok=True)
    unit.unlink()
    with Store(ParquetSource(str(location))) as store:
        assert _problems(store) == [
            (
                "rollout:ep",
                "event log broken at position 4: event 4 is missing (the next stored event "
                "is at position 6)",
            )
        ]
        assert store.status("ep").poisoned  # its claim is left: lost_in_crash
    code, text = _inspect_verify(f"parquet:///{location}")
    assert code == 1
    assert "rollout:ep: event log broken at position 4" in text


async def test_a_deleted_last_record_unit_leaves_its_seq_lost_in_crash_parquet(
    tmp_path: Path,
) -> None:
    """A unit holds a record, its ``staged`` event and its call's ``claim`` event together:
    deleting it removes all three, and the claim, a file of its own, still accounts for the
    seq."""
    location = tmp_path / "ds"
    _, second = await _rollout(ParquetSink(str(location)))
    (unit,) = [
        m
        for m in (location / "_commits").glob("*.json")
        if (location / "calls" / f"{m.stem}.parquet").exists()
        and second.call_id
        in pq.read_table(location / "calls" / f"{m.stem}.parquet")["call_id"].to_pylist()
    ]
    for table in ("calls", "blobs", "attachments", "ledger"):
        (location / table / f"{unit.stem}.parquet").unlink(missing_ok=True)
    unit.unlink()
    with Store(ParquetSource(str(location))) as store:
        problems = _problems(store)
        assert (
            "rollout:ep",
            "event log broken at position 2: event 2 is missing (the next "
            "stored event is at position 4)",
        ) in problems
        lost = [n for n in store.status("ep").not_staged if n.status == "lost_in_crash"]
        assert [(n.seq, n.call_id) for n in lost] == [(1, second.call_id)]


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_gc_removes_a_rollouts_claims_with_it(kind: str, tmp_path: Path) -> None:
    """A rollout id removed by gc may be used again: its old claims must not refuse seq 0."""
    from capture_proxy.sinks.parquet import gc_parquet
    from capture_proxy.sinks.sqlite import gc_sqlite

    where = str(tmp_path / ("c.db" if kind == "sqlite" else "ds"))
    sink: StagingSink = SQLiteSink(where) if kind == "sqlite" else ParquetSink(where)
    await _rollout(sink)  # sealed (header below), claims at seqs 0-2
    sink = SQLiteSink(where) if kind == "sqlite" else ParquetSink(where)
    source = SQLiteSource(where) if kind == "sqlite" else ParquetSource(where)
    info = source.rollout_info("ep")
    source.close_reader()
    await sink.put_rollout(replace(info, state=RolloutState.SEALED, sealed_at_ms=1))
    await sink.close()
    gc = gc_sqlite if kind == "sqlite" else gc_parquet
    assert gc(where, older_than_ms=0, now_ms=10).rollouts == ["ep"]
    sink = SQLiteSink(where) if kind == "sqlite" else ParquetSink(where)
    try:
        event = await sink.append_event(claim_event("ep", 0, "again", 20))
        assert event.position == 0
    finally:
        await sink.close()
