"""What is particular to the SQLite sink: its file format, group commit, lineage across batches
and restarts, and what a user sees when the file or the disk is wrong. (What every sink must do is
in test_sink_conformance.py.)
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest

from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import claim_event
from capture_proxy.schemas.records import CallStatus, StagedCallRecord
from capture_proxy.sinks.base import DuplicateSeq, StoreError, StoreFormatError
from capture_proxy.sinks.codec import ROW_FIELDS
from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource
from capture_proxy.sinks.sqlite._schema import CALL_COLUMNS, FORMAT_VERSION, MIGRATIONS
from tests.support import ROOT
from tests.support.sink_factories import Session, image

WORKER = "tests.support.crash_worker"  # run by `python -m` from ROOT


def db(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


async def test_creates_folders_and_reports_its_url(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "capture.db"
    sink = SQLiteSink(str(path))
    res = await sink.stage(Session("u").next()[0])
    await sink.close()
    assert res.coords is not None
    assert res.coords.store == f"sqlite:///{path}"
    named = SQLiteSink(str(path), url="sqlite:////data/capture.db")
    res = await named.stage(Session("u2").next()[0])
    await named.close()
    assert res.coords is not None
    assert res.coords.store == "sqlite:////data/capture.db"
    source = SQLiteSource(str(path), url="sqlite:////data/capture.db")
    assert source.coords(["u-c0"])[0].store == "sqlite:////data/capture.db"


async def test_file_format_is_recorded(tmp_path: Path) -> None:
    path = tmp_path / "f.db"
    await SQLiteSink(str(path)).close()
    conn = db(path)
    meta = dict(conn.execute("SELECT key, value FROM meta"))
    assert meta == {"application": "capture-proxy", "format_version": str(FORMAT_VERSION)}
    assert len(MIGRATIONS) == FORMAT_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    columns = [r[1] for r in conn.execute("PRAGMA table_info(calls)")]
    assert tuple(columns) == CALL_COLUMNS
    references = ("attachment_shas", "attachment_media_types")  # in call_attachments
    assert tuple(c for c in ROW_FIELDS if c not in references) == CALL_COLUMNS
    refs = [r[1] for r in conn.execute("PRAGMA table_info(call_attachments)")]
    assert refs == ["call_id", "sha256", "ord", "media_type"]
    conn.close()


async def test_newer_format_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    await SQLiteSink(str(path)).close()
    conn = db(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'format_version'")
    conn.close()
    expected = rf"written by a newer capture-proxy \(format 99 > {FORMAT_VERSION}\): upgrade"
    with pytest.raises(StoreFormatError, match=expected):
        SQLiteSink(str(path))
    with pytest.raises(StoreFormatError, match=expected):
        SQLiteSource(str(path))
    conn = db(path)  # refused without being touched
    assert conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone() == ("99",)
    conn.close()


async def test_foreign_files_refused_and_left_alone(tmp_path: Path) -> None:
    foreign = tmp_path / "app.db"
    conn = db(foreign)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.close()
    with pytest.raises(StoreError, match="not a capture-proxy store"):
        SQLiteSink(str(foreign))
    with pytest.raises(StoreError, match="not a capture-proxy store"):
        SQLiteSource(str(foreign))
    conn = db(foreign)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["users"]
    conn.close()

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=r"garbage\.db"):
        SQLiteSink(str(garbage))
    with pytest.raises(StoreError, match=r"garbage\.db"):
        SQLiteSource(str(garbage))
    assert garbage.read_bytes() == b"this is not a database" * 100

    with pytest.raises(StoreError, match="does not exist"):
        SQLiteSource(str(tmp_path / "missing.db"))
    assert not (tmp_path / "missing.db").exists()  # a reader never creates a file
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(StoreError, match="holds no tables"):
        SQLiteSource(str(empty))


async def test_unsealed_and_bad_attachment_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    from capture_proxy.schemas.records import Attachment

    sink = SQLiteSink(str(tmp_path / "s.db"))
    record, atts = Session("bad", image=image("bad")).next()
    with pytest.raises(ValueError, match="sealed"):
        await sink.stage(replace(record, digest=""), attachments=atts)
    ((sha, att),) = atts.items()
    forged = {sha: Attachment(sha, att.media_type, att.data + b"!")}
    result = await sink.stage(record, attachments=forged)
    assert result.status is CallStatus.CAPTURE_FAILED
    assert result.reason == "bad_attachment"
    await sink.close()
    assert list(SQLiteSource(str(tmp_path / "s.db")).all_keys()) == []


async def test_given_but_unreferenced_attachment_is_not_stored(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    sink = SQLiteSink(str(path))
    record, _ = Session("text-only").next()
    stray = image("stray")
    result = await sink.stage(record, attachments={stray.sha256: stray})
    await sink.close()
    assert result.status is CallStatus.STAGED
    source = SQLiteSource(str(path))
    assert source.unreferenced_attachments() == []
    assert source.fetch([record.call_id])[0].attachments == ()
    Store(source).verify()


class Gate:
    """A fault hook that holds the writer inside its first write until released, then counts
    (through a separate connection) how many calls were committed at each later write."""

    def __init__(self, path: Path, raise_on: int | None = None) -> None:
        self.path = path
        self.open = threading.Event()
        self.calls = 0
        self.committed_seen: list[int] = []
        self.raise_on = raise_on

    def __call__(self, point: str) -> None:
        if point != "after_record":
            return
        self.calls += 1
        if self.calls == 1:
            assert self.open.wait(10), "test never released the gate"
        reader = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        self.committed_seen.append(reader.execute("SELECT count(*) FROM calls").fetchone()[0])
        reader.close()
        if self.calls == self.raise_on:
            raise sqlite3.OperationalError("simulated I/O error in one record")


async def _queue_behind_gate(
    sink: SQLiteSink, gate: Gate, records: list[StagedCallRecord]
) -> list[object]:
    blocker = asyncio.ensure_future(sink.stage(Session("blocker").next()[0]))
    await asyncio.sleep(0.05)  # the writer is now inside the blocker's write
    tasks = [asyncio.ensure_future(sink.stage(r)) for r in records]
    await asyncio.sleep(0)  # every stage() has queued its write
    gate.open.set()
    await blocker
    return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20))


async def test_group_commit_one_transaction_for_queued_writes(tmp_path: Path) -> None:
    path = tmp_path / "g.db"
    gate = Gate(path)
    sink = SQLiteSink(str(path), fault=gate)
    records = [Session(f"g{i}").next()[0] for i in range(20)]
    results = await _queue_behind_gate(sink, gate, records)
    await sink.close()
    assert all(r.status is CallStatus.STAGED for r in results)  # type: ignore[attr-defined]
    # While the 20 queued records were written, only the blocker was committed: they shared
    # one transaction, and none was acknowledged before all of them were written.
    assert gate.committed_seen[1:] == [1] * 20
    assert len(list(SQLiteSource(str(path)).all_keys())) == 21


async def test_max_batch_splits_commits(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    gate = Gate(path)
    sink = SQLiteSink(str(path), fault=gate, max_batch=5)
    results = await _queue_behind_gate(sink, gate, [Session(f"m{i}").next()[0] for i in range(10)])
    await sink.close()
    assert all(r.status is CallStatus.STAGED for r in results)  # type: ignore[attr-defined]
    assert gate.committed_seen[1:] == [1] * 5 + [6] * 5


async def test_sqlite_error_in_one_record_fails_only_that_record(tmp_path: Path) -> None:
    path = tmp_path / "e.db"
    gate = Gate(path, raise_on=3)  # the 2nd queued record fails inside its savepoint
    sink = SQLiteSink(str(path), fault=gate)
    records = [Session(f"e{i}").next()[0] for i in range(4)]
    results = await _queue_behind_gate(sink, gate, records)
    await sink.close()
    assert isinstance(results[1], StoreError)
    assert "simulated I/O error" in str(results[1])
    assert "not" in str(results[1])
    assert "stored" in str(results[1])
    assert [getattr(r, "status", None) for i, r in enumerate(results) if i != 1] == [
        CallStatus.STAGED
    ] * 3
    source = SQLiteSource(str(path))
    assert sorted(source.all_keys()) == sorted(
        ["blocker-c0"] + [records[i].call_id for i in (0, 2, 3)]
    )
    Store(source).verify()


async def test_child_in_same_batch_as_parent(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    gate = Gate(path)
    sink = SQLiteSink(str(path), fault=gate)
    s = Session("fam")
    parent, child = s.next()[0], s.next()[0]
    results = await _queue_behind_gate(sink, gate, [parent, child])
    await sink.close()
    assert gate.committed_seen[1:] == [1, 1]  # same transaction
    coords = [r.coords for r in results]  # type: ignore[attr-defined]
    assert coords[1].prev_len == parent.cum_len
    got = SQLiteSource(str(path)).fetch([child.call_id])[0]
    assert got.prompt_token_ids == child.prompt_token_ids
    Store(SQLiteSource(str(path))).verify()


async def test_child_of_a_failed_parent_in_the_same_batch_is_stored_whole(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    gate = Gate(path, raise_on=2)  # the parent's write fails and rolls back
    sink = SQLiteSink(str(path), fault=gate)
    s = Session("orphan-parent")
    parent, child = s.next()[0], s.next()[0]
    results = await _queue_behind_gate(sink, gate, [parent, child])
    await sink.close()
    assert isinstance(results[0], StoreError)
    coords = results[1].coords  # type: ignore[attr-defined]
    assert (coords.prev_len, coords.delta_len) == (0, child.cum_len)
    source = SQLiteSource(str(path))
    assert source.fetch([child.call_id])[0].prompt_token_ids == child.prompt_token_ids
    Store(source).verify()


@pytest.mark.parametrize("cache_tokens", [0, 4_000_000])
async def test_parent_rebuilt_from_file_after_restart(tmp_path: Path, cache_tokens: int) -> None:
    path = tmp_path / "r.db"
    s = Session("restart", image=image("restart"))
    sink = SQLiteSink(str(path), cache_tokens=cache_tokens)
    first = [s.next() for _ in range(3)]
    for r, a in first:
        await sink.stage(r, attachments=a)
    await sink.close()
    sink = SQLiteSink(str(path), cache_tokens=cache_tokens)  # a new process: empty cache
    later = [s.next() for _ in range(3)]
    results = [await sink.stage(r) for r, _ in later]  # the image is already stored
    await sink.close()
    for (prev, _), res in zip([first[-1], *later[:-1]], results, strict=True):
        assert res.coords is not None
        assert res.coords.prev_len == prev.cum_len
    source = SQLiteSource(str(path))
    Store(source).verify()
    assert [r.call_id for r in source.calls("restart")] == [r.call_id for r, _ in first + later]


async def test_reader_sees_commits_made_while_it_is_open(tmp_path: Path) -> None:
    path = tmp_path / "live.db"
    sink = SQLiteSink(str(path))
    s = Session("live")
    await sink.stage(s.next()[0])
    source = SQLiteSource(str(path))
    assert len(source.calls("live")) == 1
    await sink.stage(s.next()[0])
    assert len(source.calls("live")) == 2
    await sink.close()
    source.close_reader()


async def test_cancelled_stage_still_lands_quietly(tmp_path: Path) -> None:
    # A stage timeout cancels the caller; the write is already queued and lands (the proxy then
    # marks it orphaned). Nothing may blow up delivering a result nobody waits for.
    path = tmp_path / "t.db"
    gate = Gate(path)
    sink = SQLiteSink(str(path), fault=gate)
    record = Session("late").next()[0]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(sink.stage(record), 0.05)
    gate.open.set()
    await sink.mark_orphaned(record.call_id, "stage_timeout")
    await sink.close()
    source = SQLiteSource(str(path))
    assert source.orphaned() == {record.call_id}
    assert source.calls("late") == []
    assert [r.call_id for r in source.calls("late", include_orphaned=True)] == [record.call_id]
    assert source.rollout_info("late").poisoned


async def test_damaged_lineage_is_reported_not_looped(tmp_path: Path) -> None:
    path = tmp_path / "loop.db"
    sink = SQLiteSink(str(path))
    s = Session("cyc")
    records = [s.next()[0] for _ in range(3)]
    for r in records:
        await sink.stage(r)
    await sink.close()
    conn = db(path)
    # Point the first call at the last one: a cycle only a damaged file can hold.
    conn.execute(
        "UPDATE calls SET parent_call_id = ?, prev_len = 1 WHERE call_id = ?",
        (records[2].call_id, records[0].call_id),
    )
    conn.close()
    problems = Store(SQLiteSource(str(path))).problems()
    assert {p.key for p in problems} == {r.call_id for r in records}
    assert any("loops" in p.message for p in problems)


def test_disk_full_at_commit_fails_the_whole_batch(tmp_path: Path) -> None:
    path = tmp_path / "full.db"
    proc = subprocess.run(
        [sys.executable, "-m", WORKER, str(path), "diskfull"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every stage() of the batch that could not be written raised, with a sentence saying so.
    assert report["staged"] == []
    assert all("nothing of this batch was stored" in e for e in report["errors"]), report
    assert all("full.db" in e for e in report["errors"])
    # Once space is back, the same records stage: nothing of the failed batch was left behind.
    assert report["retried"] == ["staged"] * len(report["keys"])
    source = SQLiteSource(str(path))
    assert sorted(source.all_keys()) == sorted([report["first"], *report["keys"]])
    Store(source).verify()


async def test_a_call_claims_its_seq_once_and_its_record_still_stages(tmp_path: Path) -> None:
    sink = SQLiteSink(str(tmp_path / "s.db"))
    record, _ = Session("once").next()
    await sink.append_event(claim_event("once", 0, record.call_id, 1))
    with pytest.raises(DuplicateSeq) as again:
        await sink.append_event(claim_event("once", 0, record.call_id, 2))
    assert again.value.holder == record.call_id
    assert (await sink.stage(record)).status is CallStatus.STAGED
    await sink.close()


async def test_a_session_stores_each_message_once_however_often_it_is_resent(
    tmp_path: Path,
) -> None:
    sink = SQLiteSink(str(tmp_path / "s.db"))
    session = Session("resent")
    records = [session.next()[0] for _ in range(4)]
    for r in records:
        assert (await sink.stage(r)).status is CallStatus.STAGED
    await sink.close()
    distinct = {orjson.dumps(m) for r in records for m in r.request["messages"]}
    (blobs,) = db(tmp_path / "s.db").execute("SELECT count(*) FROM blobs").fetchone()
    assert blobs == len(distinct) + 1  # and the rest of the request, the same every call
    source = SQLiteSource(str(tmp_path / "s.db"))
    assert [r.request for r in source.fetch([r.call_id for r in records])] == [
        r.request for r in records
    ]


async def test_one_writer_per_file_whatever_path_names_it(tmp_path: Path) -> None:
    # Issue 27: two proxies given the file and a symlink to it both started, and every third
    # call was a duplicate seq. The lock now sits beside the file the links lead to.
    first = SQLiteSink(str(tmp_path / "store.db"))
    (tmp_path / "link.db").symlink_to(tmp_path / "store.db")
    (tmp_path / "sub").mkdir()
    try:
        for other in (tmp_path / "link.db", tmp_path / "sub" / ".." / "store.db"):
            with pytest.raises(StoreError, match=r"another capture-proxy .* is writing"):
                SQLiteSink(str(other))
    finally:
        await first.close()
    second = SQLiteSink(str(tmp_path / "link.db"))  # free again once the first writer is gone
    await second.close()


async def test_a_store_file_with_two_hard_links_is_refused(tmp_path: Path) -> None:
    sink = SQLiteSink(str(tmp_path / "store.db"))
    await sink.close()
    (tmp_path / "other.db").hardlink_to(tmp_path / "store.db")
    for name in ("store.db", "other.db"):
        with pytest.raises(StoreError, match="has 2 hard links"):
            SQLiteSink(str(tmp_path / name))
