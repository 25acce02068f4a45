"""One call per (rollout, seq): every sink refuses a second one (a staged record as
``capture_failed``/``duplicate_seq``, a ledger entry with `DuplicateSeq`), the writer keeps going,
and `verify` / ``inspect --verify`` report duplicates a store already holds."""

from __future__ import annotations

import asyncio
import io
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capture_proxy.core.capture import Capture
from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.library import CaptureClient
from capture_proxy.read.reader import Store, StoreCorrupted
from capture_proxy.schemas.records import CallStatus, LedgerEntry
from capture_proxy.sinks.base import DuplicateSeq
from capture_proxy.sinks.codec import encode_record
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.registry import open_sink
from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource
from capture_proxy.sinks.sqlite._schema import CALL_COLUMNS_3, FORMAT_VERSION, MIGRATIONS
from tests.support import FIXTURES as SUPPORT_FIXTURES
from tests.support.sink_factories import SINKS, Session, SinkCase

FIXTURES = SUPPORT_FIXTURES / "vllm-0.32.0"


@pytest.fixture(params=sorted(SINKS))
async def case(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SinkCase]:
    c = SINKS[request.param](tmp_path)
    yield c
    await c.sink.close()


def _failure(call_id: str, seq: int, rollout_id: str = "r") -> LedgerEntry:
    return LedgerEntry(
        rollout_id, call_id, seq, CallStatus.REJECTED, "test", "refused", 422, int(time.time())
    )


async def test_a_second_record_at_a_seq_is_refused_and_the_writer_goes_on(case: SinkCase) -> None:
    a, b = Session("r", prefix="a", schema_version=1), Session("r", prefix="b", schema_version=1)
    first, _ = a.next()
    assert (await case.sink.stage(first)).status == "staged"
    clash, _ = b.next()  # seq 0 again, another call
    result = await case.sink.stage(clash)
    assert result.status == "capture_failed"
    assert result.reason == "duplicate_seq"
    assert result.message == f"rollout r already holds seq 0 (call {first.call_id})"
    after, _ = a.next()
    assert (await case.sink.stage(after)).status == "staged"
    src = case.reopen()
    assert [(s.seq, s.call_id) for s in src.summaries("r")] == [
        (0, first.call_id),
        (1, after.call_id),
    ]
    Store(src).verify()


async def test_a_ledger_entry_cannot_take_another_calls_seq(case: SinkCase) -> None:
    session = Session("r")
    staged, _ = session.next()
    assert (await case.sink.stage(staged)).status == "staged"
    with pytest.raises(DuplicateSeq, match="rollout r already holds seq 0"):
        await case.sink.record_failure(_failure("x0", 0))
    await case.sink.record_failure(_failure("x1", 1))
    with pytest.raises(DuplicateSeq, match=r"seq 1 \(call x1\)"):
        await case.sink.record_failure(_failure("x2", 1))
    clash, _ = session.next()  # seq 1, held by the ledger entry of x1
    result = await case.sink.stage(clash)
    assert result.reason == "duplicate_seq"
    src = case.reopen()
    assert [f.call_id for f in src.failures("r")] == ["x1"]
    assert [s.seq for s in src.summaries("r")] == [0]


async def test_a_calls_own_record_and_ledger_entry_share_its_seq(case: SinkCase) -> None:
    # A write that outlived its stage timeout: the call is in the ledger as capture_failed and
    # its record lands later (then marked orphaned), in either order.
    session = Session("r")
    late, _ = session.next()
    entry = LedgerEntry(
        "r", late.call_id, 0, CallStatus.CAPTURE_FAILED, "stage_timeout", "", None, 1
    )
    await case.sink.record_failure(entry)
    assert (await case.sink.stage(late)).status == "staged"
    await case.sink.mark_orphaned(late.call_id, "stage_timeout")
    landed, _ = session.next()
    assert (await case.sink.stage(landed)).status == "staged"
    entry = LedgerEntry(
        "r", landed.call_id, 1, CallStatus.CAPTURE_FAILED, "stage_timeout", "", None, 1
    )
    await case.sink.record_failure(entry)
    Store(case.reopen()).verify()


async def test_one_batch_takes_one_of_two_records_at_a_seq(case: SinkCase) -> None:
    records = [Session("r", prefix=p).next()[0] for p in "abcd"]
    results = await asyncio.gather(*(case.sink.stage(r) for r in records))
    assert sorted(r.status for r in results) == ["capture_failed"] * 3 + ["staged"]
    assert {r.reason for r in results if r.status != "staged"} == {"duplicate_seq"}
    assert len(case.reopen().summaries("r")) == 1


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_reopened_store_still_refuses_duplicates(tmp_path: Path, kind: str) -> None:
    c = SINKS[kind](tmp_path)
    first, _ = Session("r", prefix="a").next()
    assert (await c.sink.stage(first)).status == "staged"
    await c.sink.record_failure(_failure("x1", 1))
    await c.sink.close()
    again = SINKS[kind](tmp_path)
    try:
        clash, _ = Session("r", prefix="b").next()
        assert (await again.sink.stage(clash)).reason == "duplicate_seq"
        with pytest.raises(DuplicateSeq):
            await again.sink.record_failure(_failure("x2", 1))
    finally:
        await again.sink.close()


async def test_a_duplicate_the_store_refuses_is_capture_failed_naming_the_seq(
    tmp_path: Path,
) -> None:
    # A client whose reader does not see its store (here: an empty in-process one) cannot resume
    # a rollout: its first call after a restart takes seq 0 again. The store refuses it, loudly.
    url = f"sqlite:///{tmp_path / 'lib.db'}"
    answer = orjson.loads((FIXTURES / "chat-response.json").read_bytes())
    body = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
    blind = MemorySink("memory://blind")
    for expected in ("staged", "capture_failed"):
        client = CaptureClient(open_sink(url), source=lambda: blind)
        call = await client.begin_call("ep", body)
        result = await client.complete_call(call, answer)
        assert result.status == expected
        await client.close()
    assert result.reason == "duplicate_seq"
    assert "rollout ep already holds seq 0" in (result.message or "")


async def test_the_ledger_drops_an_entry_the_store_refuses_for_good(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'core.db'}"
    sink = open_sink(url)
    await sink.record_failure(_failure("earlier", 0, rollout_id="ep"))
    capture = Capture(sink)  # no reader: it does not know seq 0 is taken
    await capture.reject("ep", "test", "refused", 422)
    await capture.reject("ep", "test", "refused", 422)  # not stuck behind the refused one
    assert not capture.ledger.held
    assert capture.ledger.refused == 1
    await sink.close()
    with Store(SQLiteSource(str(tmp_path / "core.db"))) as store:
        assert [(f.seq, f.call_id == "earlier") for f in store.failures("ep")] == [
            (0, True),
            (1, False),
        ]


# -- stores that already hold duplicates --------------------------------------------------------


def _format_2_store_with_duplicates(path: Path) -> list[str]:
    """A store as format 2 wrote it (no rule against duplicate seqs), holding two calls at seq 0
    and a ledger entry at seq 1 beside a record at seq 1."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    MIGRATIONS[0](conn)
    MIGRATIONS[1](conn)
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'format_version'")
    keys = []
    a, b = Session("r", prefix="a", schema_version=1), Session("r", prefix="b", schema_version=1)
    for session in (a, b, a):
        record, _ = session.next()
        enc = encode_record(record, None)
        conn.executemany("INSERT OR IGNORE INTO blobs (key, data) VALUES (?, ?)", enc.blobs.items())
        marks = ",".join("?" * len(CALL_COLUMNS_3))
        conn.execute(
            f"INSERT INTO calls ({', '.join(CALL_COLUMNS_3)}) VALUES ({marks})",
            [enc.row[c] for c in CALL_COLUMNS_3],
        )
        keys.append(record.call_id)
    conn.execute("INSERT INTO rollouts VALUES ('r', 'open', 0, NULL, '{}', '{}')")
    conn.execute(
        "INSERT INTO failures VALUES ('r', 'x1', 1, 'rejected', 'test', 'refused', 422, 0)"
    )
    conn.execute("COMMIT")
    conn.close()
    return keys


def _inspect_verify(target: str) -> tuple[int, str]:
    out = io.StringIO()
    return inspect_main([target, "--verify"], stdout=out), out.getvalue()


async def test_a_store_with_duplicates_migrates_and_verify_reports_them(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    a0, b0, a1 = _format_2_store_with_duplicates(path)
    # Format 2 reads as it is.
    with Store(SQLiteSource(str(path))) as store, pytest.raises(StoreCorrupted) as e:
        store.verify()
    assert [(p.key, p.message) for p in e.value.problems] == [
        ("rollout:r", f"seq 0 is held by 2 calls ({a0}, {b0})"),
        ("rollout:r", f"seq 1 is held by 2 calls ({a1}, x1)"),
    ]
    sink = SQLiteSink(str(path))  # the migration does not trip over what the file holds
    clash, _ = Session("r", prefix="c").next()
    assert (await sink.stage(clash)).reason == "duplicate_seq"
    await sink.close()
    with sqlite3.connect(path) as conn:
        (version,) = conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()
        assert version == str(FORMAT_VERSION)
        # The triggers refuse even a write that skips the sink's own check.
        with pytest.raises(sqlite3.IntegrityError, match="duplicate_seq"):
            conn.execute("INSERT INTO failures VALUES ('r', 'x9', 0, 'rejected', 't', 'm', 422, 0)")
    code, text = _inspect_verify(str(path))
    assert code == 1
    assert f"rollout:r: seq 0 is held by 2 calls ({a0}, {b0})" in text
    assert f"rollout:r: seq 1 is held by 2 calls ({a1}, x1)" in text


async def test_verify_reports_duplicate_seqs_in_a_parquet_dataset(tmp_path: Path) -> None:
    location = tmp_path / "dataset"
    sink = ParquetSink(str(location))
    session = Session("r")
    first, _ = session.next()
    assert (await sink.stage(first)).status == "staged"
    await sink.record_failure(_failure("x1", 1))
    await sink.close()
    # An older writer (or a second one) put the ledger entry at seq 0: rewrite its unit so.
    (ledger,) = [f for f in location.rglob("*.parquet") if "x1" in str(pq.read_table(f))]
    table = pq.read_table(ledger)
    # Only the ledger row: its event (kind "event") keeps seq 1, as an older writer wrote none.
    ids, old = table["call_id"].to_pylist(), table["seq"].to_pylist()
    kinds = table["kind"].to_pylist()
    seqs = [
        0 if cid == "x1" and k == "failure" else s
        for cid, s, k in zip(ids, old, kinds, strict=True)
    ]
    at = table.column_names.index("seq")
    table = table.set_column(
        at, table.schema.field(at), pa.array(seqs, table.schema.field(at).type)
    )
    pq.write_table(table, ledger)
    with Store(ParquetSource(str(location))) as store, pytest.raises(StoreCorrupted) as e:
        store.verify()
    assert [(p.key, p.message) for p in e.value.problems] == [
        ("rollout:r", f"seq 0 is held by 2 calls ({first.call_id}, x1)")
    ]
    code, text = _inspect_verify(f"parquet:///{location}")
    assert code == 1
    assert f"rollout:r: seq 0 is held by 2 calls ({first.call_id}, x1)" in text
