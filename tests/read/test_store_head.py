"""The store head: a writer publishes one hash over every rollout's chain head with its commits
(its log, ``/metrics``), and a store checked against the last one kept shows a rollout deleted
whole (which no per-rollout check can see: nothing of it is left) or rewritten consistently
from the public spec, on SQLite and on Parquet."""

from __future__ import annotations

import io
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.read.reader import StoreCorrupted, open_store
from capture_proxy.schemas.events import claim_event, event_hash
from capture_proxy.schemas.store_head import StoreHead
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.sqlite import SQLiteSink
from capture_proxy.sinks.store_head import StoreHeadKeeper
from tests.read.test_tamper import KINDS, _call, _seal
from tests.support.proxy_harness import chat_body, user
from tests.support.sink_factories import Session


async def write(kind: str, tmp_path: Path) -> tuple[str, Path, StoreHead]:
    """Two sealed rollouts, ``ep`` and ``ok``; the store head the writer published last."""
    where = tmp_path / ("c.db" if kind == "sqlite" else "ds")
    sink = SQLiteSink(str(where)) if kind == "sqlite" else ParquetSink(str(where))
    for rollout_id, calls in (("ep", 3), ("ok", 2)):
        session = Session(rollout_id)
        for _ in range(calls):
            await _call(sink, session.next()[0])
        await _seal(sink, rollout_id, False, 0.5)
    assert isinstance(sink.store_head, StoreHeadKeeper)
    await sink.close()
    url = f"sqlite:///{where}" if kind == "sqlite" else f"parquet:///{where}"
    return url, where, sink.store_head.current()


def delete_rollout(kind: str, where: Path, rollout_id: str) -> None:
    """Remove a rollout whole: its records, ledger, header, events (and claim files)."""
    if kind == "sqlite":
        with sqlite3.connect(where) as db:
            for table, column in (
                ("calls", "rollout_id"),
                ("failures", "rollout_id"),
                ("events", "rollout_id"),
                ("rollouts", "id"),
            ):
                db.execute(f"DELETE FROM {table} WHERE {column} = ?", (rollout_id,))
        db.close()
        return
    for table in ("calls", "ledger"):
        for f in sorted((where / table).glob("*.parquet")):
            t = pq.read_table(f)
            rows = [r for r in t.to_pylist() if r["rollout_id"] != rollout_id]
            pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), f)
    for claim in (where / "claims").rglob("*"):
        if claim.is_file() and f'"{rollout_id}"'.encode() in claim.read_bytes():
            claim.unlink()


def rewrite_last_event_time(kind: str, where: Path, rollout_id: str) -> None:
    """Move the seal of `rollout_id` to another time and rehash it from the public spec: the
    chain holds and the header agrees, so only an anchor sees it."""

    def rehash(e: dict[str, Any], body: dict[str, Any]) -> str:
        return event_hash(rollout_id, e["position"], e["kind"], None, None, 7, body, e["prev_hash"])

    if kind == "sqlite":
        with sqlite3.connect(where) as db:
            position, prev = db.execute(
                "SELECT position, prev_hash FROM events WHERE rollout_id = ? AND kind = 'seal'",
                (rollout_id,),
            ).fetchone()
            new = rehash({"position": position, "kind": "seal", "prev_hash": prev}, {})
            db.execute(
                "UPDATE events SET at_ms = 7, hash = ? WHERE rollout_id = ? AND position = ?",
                (new, rollout_id, position),
            )
        db.close()
        return
    for f in sorted((where / "ledger").glob("*.parquet")):
        t = pq.read_table(f)
        rows = t.to_pylist()
        for r in rows:
            if r["kind"] == "event" and r["rollout_id"] == rollout_id and r["event_kind"] == "seal":
                r["at_ms"] = 7
                r["hash"] = rehash({**r, "kind": "seal"}, {})
        pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), f)


@pytest.mark.parametrize("kind", KINDS)
async def test_the_published_head_is_the_one_recomputed_from_the_store(
    kind: str, tmp_path: Path
) -> None:
    url, where, kept = await write(kind, tmp_path)
    with open_store(url) as store:
        assert store.store_head() == kept
        assert (kept.rollouts, kept.events) == (2, 14)  # a claim and a staged event a call, 2 more
        store.verify(expected_store_head=kept.token())
        store.verify(expected_store_head=kept.head)  # the hash alone is enough to check
    out = io.StringIO()
    assert inspect_main([url, "--verify", "--expected-store-head", kept.token()], stdout=out) == 0
    # A writer opening the store again starts from the same head.
    sink = SQLiteSink(str(where)) if kind == "sqlite" else ParquetSink(str(where))
    try:
        assert isinstance(sink.store_head, StoreHeadKeeper)
        assert sink.store_head.current() == kept
    finally:
        await sink.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_rollout_deleted_whole_is_caught_against_the_kept_head(
    kind: str, tmp_path: Path
) -> None:
    url, where, kept = await write(kind, tmp_path)
    delete_rollout(kind, where, "ok")
    with open_store(url) as store:
        assert store.rollouts() == ["ep"]
        store.verify()  # nothing of it is left for a per-rollout check to see
        with pytest.raises(StoreCorrupted) as caught:
            store.verify(expected_store_head=kept.token())
        (problem,) = caught.value.problems
        assert problem.key == "store"
        assert "1 rollout(s) the kept head covers are gone (deleted)" in problem.message
    out = io.StringIO()
    assert inspect_main([url, "--verify", "--expected-store-head", kept.token()], stdout=out) == 1
    assert "are gone (deleted)" in out.getvalue()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_rollout_rewritten_from_the_spec_is_caught_against_the_kept_head(
    kind: str, tmp_path: Path
) -> None:
    url, where, kept = await write(kind, tmp_path)
    rewrite_last_event_time(kind, where, "ep")
    with open_store(url) as store:
        store.verify()  # the chain holds, the header agrees
        with pytest.raises(StoreCorrupted, match="a rollout was rewritten or replaced"):
            store.verify(expected_store_head=kept.token())


async def test_the_writer_logs_the_head_it_leaves_the_store_at(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capture_proxy.store_head")
    _, _, kept = await write("sqlite", tmp_path)
    lines = [r for r in caplog.records if r.name == "capture_proxy.store_head"]
    assert "at open" in lines[0].getMessage()
    assert lines[-1].__dict__["store_head"]["store_head"] == kept.head
    assert kept.token() in lines[-1].getMessage()


async def test_metrics_show_the_store_head_an_operator_keeps(make_proxy: Any) -> None:
    """A running proxy's ``/metrics`` carries the head its store is at after the last commit,
    the one `Store.verify` recomputes (read with Prometheus' own text parser)."""
    p = await make_proxy()
    await p.chat(chat_body(user("x")))
    text = await (await p.client.get("/metrics")).text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (info,) = families["capture_proxy_store_head_info"].samples
    (count,) = families["capture_proxy_store_head_rollouts"].samples
    with open_store(p.store_url) as store:
        head = store.store_head()
    assert info.labels == {
        "head": head.head,
        "rollouts": str(head.rollouts),
        "events": str(head.events),
        "claims": str(head.claims),
    }
    assert info.value == 1.0
    assert count.value == head.rollouts == 1


def test_a_malformed_kept_head_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = io.StringIO()
    status = inspect_main(
        [str(tmp_path / "c.db"), "--verify", "--expected-store-head", "xyz"], stdout=out
    )
    assert status == 2
    assert "64 hex characters" in out.getvalue() + capsys.readouterr().err


async def test_an_admitted_calls_claim_deleted_from_an_open_rollout_is_caught_on_sqlite(
    tmp_path: Path,
) -> None:
    """A proxy stopped with a call in flight leaves its claim event (``lost_in_crash``: the
    rollout reads as poisoned). Deleting that claim, the tail of an open rollout's log, leaves a
    chain that holds and a rollout that reads as clean with ``include_open=True``; the store
    head its writer published after the claim committed shows the log was cut short.
    (On Parquet the claim's event waits for the next unit and its claim file is the only trace,
    which the store head covers: tests/read/test_store_head_claims.py.)"""
    where = tmp_path / "c.db"
    sink = SQLiteSink(str(where))
    session = Session("ep")
    first, second = session.next()[0], session.next()[0]
    await _call(sink, first)
    await sink.append_event(claim_event("ep", second.seq, second.call_id, 2))
    kept = sink.store_head.current()
    await sink.close()
    url = f"sqlite:///{where}"
    with open_store(url) as store:
        assert store.status("ep").poisoned
    with sqlite3.connect(where) as db:
        db.execute("DELETE FROM events WHERE call_id = ?", (second.call_id,))
    db.close()
    with open_store(url) as store:
        assert not store.status("ep").poisoned
        store.verify()
        assert len(store.trajectory("ep", include_open=True).calls) == 1
        with pytest.raises(StoreCorrupted, match="1 event\\(s\\) fewer: a rollout was cut short"):
            store.verify(expected_store_head=kept.token())


async def test_an_event_hash_of_another_type_is_a_store_problem_against_a_kept_head(
    tmp_path: Path,
) -> None:
    url, where, kept = await write("sqlite", tmp_path)
    with sqlite3.connect(where) as db:
        db.execute("UPDATE events SET hash = 5 WHERE rollout_id = 'ok'")
    db.close()
    with open_store(url) as store:
        with pytest.raises(StoreCorrupted) as caught:
            store.verify(expected_store_head=kept.token())
        (problem,) = [p for p in caught.value.problems if p.key == "store"]
        assert "a rollout was rewritten or replaced" in problem.message
        assert store.store_head().head != kept.head
