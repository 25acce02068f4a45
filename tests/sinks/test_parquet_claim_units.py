"""A Parquet claim is durable as its claim file and writes no unit of its own: its event commits
with the next unit written (its call's record in the common case), or at close. A crash, or a
failed unit, before then leaves the claim file alone, which readers report as ``lost_in_crash``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from capture_proxy.read.reader import Store
from capture_proxy.read.status import LOST_IN_CRASH
from capture_proxy.schemas.events import claim_event
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from tests.support.sink_factories import Session


def _units(ds: Path) -> int:
    return len(list((ds / "_commits").glob("*.json")))


async def test_a_call_claimed_then_staged_writes_one_unit(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds))
    session = Session("ep")
    try:
        for seq in range(3):
            record, _ = session.next()
            before = _units(ds)
            claim = await sink.append_event(claim_event("ep", seq, record.call_id, seq))
            assert (claim.position, claim.kind) == (2 * seq, "claim")
            # The claim is the store's as soon as it returns: its file, before any unit.
            assert ParquetSource(str(ds)).claims("ep")[seq] == record.call_id
            assert _units(ds) == before
            assert (await sink.stage(record)).status is CallStatus.STAGED
            assert _units(ds) == before + 1
    finally:
        await sink.close()
    events = ParquetSource(str(ds)).events("ep")
    assert [(e.position, e.kind, e.seq) for e in events] == [
        (0, "claim", 0),
        (1, "staged", 0),
        (2, "claim", 1),
        (3, "staged", 1),
        (4, "claim", 2),
        (5, "staged", 2),
    ]
    Store(ParquetSource(str(ds))).verify()


async def test_a_claim_whose_call_has_not_ended_reads_as_in_flight_then_commits_at_close(
    tmp_path: Path,
) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds))
    staged, _ = Session("ep").next()
    await sink.append_event(claim_event("ep", 0, staged.call_id, 1))
    await sink.stage(staged)
    await sink.append_event(claim_event("ep", 1, "in-flight", 2))
    # What a reader beside the proxy, or after a crash now, sees: the claim without its call.
    status = Store(ParquetSource(str(ds))).status("ep")
    assert status.poisoned
    assert [(n.seq, n.call_id, n.status) for n in status.not_staged] == [
        (1, "in-flight", LOST_IN_CRASH)
    ]
    assert [e.kind for e in ParquetSource(str(ds)).events("ep")] == ["claim", "staged"]
    await sink.close()
    events = ParquetSource(str(ds)).events("ep")
    assert [(e.kind, e.call_id) for e in events] == [
        ("claim", staged.call_id),
        ("staged", staged.call_id),
        ("claim", "in-flight"),
    ]
    Store(ParquetSource(str(ds))).verify()


async def test_a_failed_unit_drops_the_waiting_claim_events_and_the_claims_stand(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds))
    first, _ = Session("ok").next()
    assert (await sink.stage(first)).status is CallStatus.STAGED
    claimed, _ = Session("ep").next()
    await sink.append_event(claim_event("ep", 0, claimed.call_id, 1))
    # The ledger folder turns into a file: the next unit (the one the claim event waits for)
    # fails, and its caller hears it; the claim, already answered, stays the store's.
    (ds / "ledger").rename(ds / "ledger.aside")
    (ds / "ledger").write_bytes(b"")
    other, _ = Session("nope").next()
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(StoreError, match="nothing of this batch was stored"),
    ):
        await sink.stage(other)
    assert "claims stand, without events, as after a crash" in caplog.text
    (ds / "ledger").unlink()
    (ds / "ledger.aside").rename(ds / "ledger")
    assert ParquetSource(str(ds)).claims("ep") == {0: claimed.call_id}
    # The claimed call still stages; its chain starts at its staged event.
    assert (await sink.stage(claimed)).status is CallStatus.STAGED
    await sink.close()
    source = ParquetSource(str(ds))
    assert [(e.position, e.kind) for e in source.events("ep")] == [(0, "staged")]
    assert not Store(source).status("ep").poisoned
    Store(source).verify()


async def test_a_failed_last_unit_at_close_is_logged_and_the_claim_stands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds))
    await sink.append_event(claim_event("ep", 0, "in-flight", 1))
    (ds / "ledger").rename(ds / "ledger.aside")
    (ds / "ledger").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        await sink.close()
    assert "the last unit, of waiting claim events, failed" in caplog.text
    assert "their claims stand" in caplog.text
    (ds / "ledger").unlink()
    (ds / "ledger.aside").rename(ds / "ledger")
    source = ParquetSource(str(ds))
    assert source.claims("ep") == {0: "in-flight"}
    assert _units(ds) == 0  # the rollout is known by its claim alone, as after a crash
