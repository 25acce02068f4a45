"""`LedgerWriter` while the sink fails: entries held in order, counted when pushed out, spilled
to the journal at exit (the proxy-level path: tests/reliability/test_ledger_journal.py)."""

from __future__ import annotations

from pathlib import Path

from capture_proxy.core.journal import read_journal
from capture_proxy.core.ledger import LedgerWriter
from capture_proxy.schemas.records import CallStatus, LedgerEntry
from capture_proxy.sinks.sqlite import SQLiteSink


def _entry(seq: int) -> LedgerEntry:
    return LedgerEntry("r1", f"c{seq}", seq, CallStatus.UPSTREAM_ERROR, "upstream_502", "bad gw")


async def test_held_entries_over_the_limit_are_counted_and_the_rest_spilled(
    tmp_path: Path,
) -> None:
    sink = SQLiteSink(str(tmp_path / "s.db"))
    await sink.close()  # a sink that refuses every write, for real
    ledger = LedgerWriter(sink, timeout=5.0, max_held=2)
    for seq in range(3):
        await ledger.write(_entry(seq))
    assert [e.seq for e in ledger.held] == [1, 2]
    assert ledger.dropped == 1  # logged in full when it was pushed out
    journal = tmp_path / "s.db.ledger-journal.jsonl"
    assert ledger.spill(str(journal)) == 2
    assert not ledger.held
    assert ledger.spilled_to == str(journal)
    assert ledger.unsaved == 3  # the proxy exits 1
    assert [e.call_id for e in read_journal(str(journal))] == ["c1", "c2"]


async def test_nothing_held_means_nothing_spilled(tmp_path: Path) -> None:
    sink = SQLiteSink(str(tmp_path / "s.db"))
    ledger = LedgerWriter(sink, timeout=5.0)
    await ledger.write(_entry(0))
    await sink.close()
    assert ledger.spill(str(tmp_path / "j.jsonl")) == 0
    assert ledger.unsaved == 0
    assert not (tmp_path / "j.jsonl").exists()
