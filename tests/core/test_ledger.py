"""`LedgerWriter` while the sink fails: entries held in order, counted when pushed out, held until
the recovered sink has taken them, spilled to the journal at exit (the proxy-level path:
tests/reliability/test_ledger_journal.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from capture_proxy.core.journal import read_journal
from capture_proxy.core.ledger import LedgerWriter
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus, LedgerEntry
from capture_proxy.sinks.base import StoreError
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


class RecoveringSink(SQLiteSink):
    """A SQLite sink whose ledger writes fail while `failing`; once it recovers, each ledger
    write starts (`writing` is set) and then waits for `gate`, as on a slow disk."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.failing = True
        self.writing = asyncio.Event()
        self.gate = asyncio.Event()

    async def record_failure(self, entry: LedgerEntry) -> None:
        if self.failing:
            raise StoreError("No space left on device")
        self.writing.set()
        await self.gate.wait()
        await super().record_failure(entry)


def _in_store(tmp_path: Path) -> list[str]:
    with open_store(f"sqlite:///{tmp_path / 's.db'}") as store:
        return [f.call_id for f in store.failures("r1")]


async def test_a_held_entry_stays_held_until_the_recovered_sink_has_taken_it(
    tmp_path: Path,
) -> None:
    # /readyz and the held-entries gauge read `held`: an entry that left it before the store had
    # it made the proxy report its ledger written while the write was still going on.
    sink = RecoveringSink(str(tmp_path / "s.db"))
    ledger = LedgerWriter(sink, timeout=30.0)
    for seq in range(2):
        await ledger.write(_entry(seq))
    sink.failing = False
    flush = asyncio.create_task(ledger.flush())
    await sink.writing.wait()
    assert [e.seq for e in ledger.held] == [0, 1]
    # A new entry meanwhile (a call that fails now) queues behind them; nothing is sent twice.
    later = asyncio.create_task(ledger.write(_entry(2)))
    await asyncio.sleep(0)
    assert [e.seq for e in ledger.held] == [0, 1, 2]
    sink.gate.set()
    assert await flush == 0
    await later
    assert not ledger.held
    await sink.close()
    assert _in_store(tmp_path) == ["c0", "c1", "c2"]


async def test_a_flush_cancelled_mid_write_leaves_the_write_to_finish_as_a_late_one(
    tmp_path: Path,
) -> None:
    # Shutdown cancels the periodic flush: the entry being written is neither lost nor sent twice.
    sink = RecoveringSink(str(tmp_path / "s.db"))
    ledger = LedgerWriter(sink, timeout=30.0)
    await ledger.write(_entry(0))
    sink.failing = False
    flush = asyncio.create_task(ledger.flush())
    await sink.writing.wait()
    flush.cancel()
    await asyncio.gather(flush, return_exceptions=True)
    assert not ledger.held
    assert ledger.late == 1
    sink.gate.set()
    await ledger.drain(30.0)
    assert ledger.late == 0
    assert not ledger.held
    await sink.close()
    assert _in_store(tmp_path) == ["c0"]
