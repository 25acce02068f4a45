"""A store edited behind the proxy's back is never read as clean: each tampering of issue 29, on
SQLite and on Parquet, is refused by every trainer-facing read (`Store.verify`,
``inspect --verify``, `calls`, `trajectory`, `iter_trajectories`, `export_store` and the
``export`` command), while the store's untouched rollout reads as before.

The store holds two sealed rollouts written as the proxy writes them (claims, records with their
``staged`` events, an outcome: header then event, the sealed header then the ``seal`` event):
``ep`` (three calls, reward 0.1) and ``ok`` (two calls). The edits use the public spec only
(digests recomputed with `seal_record`), as someone holding the store file could.
"""

from __future__ import annotations

import io
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capture_proxy.cli import main as cli_main
from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.read.export import export_store
from capture_proxy.read.reader import RolloutExcluded, StoreCorrupted, open_store
from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.events import EventDraft, EventKind, claim_event
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import (
    CallStatus,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from capture_proxy.sinks.base import StagingSink
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.sqlite import SQLiteSink
from capture_proxy.sinks.sqlite._schema import CALL_COLUMNS
from tests.support.sink_factories import Session

KINDS = ["sqlite", "parquet"]


@dataclass
class Written:
    kind: str
    url: str
    where: Path
    records: list[StagedCallRecord]


async def _call(sink: StagingSink, record: StagedCallRecord) -> None:
    await sink.append_event(claim_event(record.rollout_id, record.seq, record.call_id, 1))
    assert (await sink.stage(record)).status is CallStatus.STAGED


async def _seal(sink: StagingSink, rollout_id: str, poisoned: bool, reward: float) -> None:
    """The driver's outcome, then its seal, each as the proxy writes it."""
    outcome = RolloutOutcome(reward, "g", at_ms=5)
    header = RolloutInfo(
        rollout_id, RolloutState.OPEN, poisoned, 1, None, outcome_history=(outcome,)
    )
    await sink.put_rollout(header)
    body = {"reward": reward, "group_id": "g", "revision": 1}
    await sink.append_event(EventDraft(rollout_id, EventKind.OUTCOME, 5, body=body))
    await sink.put_rollout(replace(header, state=RolloutState.SEALED, sealed_at_ms=6))
    await sink.append_event(EventDraft(rollout_id, EventKind.SEAL, 6))


async def write(kind: str, tmp_path: Path, *, poisoned: bool = False) -> Written:
    where = tmp_path / ("c.db" if kind == "sqlite" else "ds")
    sink: StagingSink = SQLiteSink(str(where)) if kind == "sqlite" else ParquetSink(str(where))
    session = Session("ep")
    records = [session.next()[0] for _ in range(3)]
    for record in records:
        await _call(sink, record)
    if poisoned:  # a fourth call answered and not staged
        await sink.append_event(claim_event("ep", 3, "lost", 2))
        await sink.record_failure(
            LedgerEntry(
                "ep", "lost", 3, CallStatus.CAPTURE_FAILED, "stage_timeout", "slow", None, 3
            )
        )
    await _seal(sink, "ep", poisoned, 0.1)
    other = Session("ok")
    for _ in range(2):
        await _call(sink, other.next()[0])
    await _seal(sink, "ok", False, 1.0)
    await sink.close()
    url = f"sqlite:///{where}" if kind == "sqlite" else f"parquet:///{where}"
    return Written(kind, url, where, records)


# -- editing a store behind its back ------------------------------------------------------------


def _sql(w: Written, *statements: tuple[str, tuple[Any, ...]]) -> None:
    with sqlite3.connect(w.where) as db:
        for sql, args in statements:
            db.execute(sql, args)
    db.close()


Rows = list[dict[str, Any]]


def _rows(w: Written, table: str, edit: Callable[[Rows], Rows]) -> None:
    """Rewrite every file of a Parquet table with `edit` applied to its rows."""
    for f in sorted((w.where / table).glob("*.parquet")):
        t = pq.read_table(f)
        rows = t.to_pylist()
        edited = edit([dict(r) for r in rows])
        if edited != rows:
            pq.write_table(pa.Table.from_pylist(edited, schema=t.schema), f)


def _event_of(row: dict[str, Any], call_id: str | None = None, kind: str | None = None) -> bool:
    return (
        row["kind"] == "event"
        and row["rollout_id"] == "ep"
        and (call_id is None or row["call_id"] == call_id)
        and (kind is None or row["event_kind"] == kind)
    )


def copy_record(w: Written, source: StagedCallRecord, call_id: str, seq: int) -> None:
    """Store a copy of `source` as call `call_id` at `seq`, its digest recomputed from the spec."""
    forged = seal_record(replace(source, call_id=call_id, seq=seq, digest="", extras_digest=""))
    if w.kind == "sqlite":
        cols = ", ".join(CALL_COLUMNS)
        picked = ", ".join(
            {"call_id": "?", "seq": "?", "digest": "?"}.get(c, c) for c in CALL_COLUMNS
        )
        _sql(
            w,
            ("DROP TRIGGER IF EXISTS calls_one_per_seq", ()),
            (
                f"INSERT INTO calls ({cols}) SELECT {picked} FROM calls WHERE call_id = ?",
                (call_id, seq, forged.digest, source.call_id),
            ),
        )
    else:

        def add(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
            extra = [
                {**r, "call_id": call_id, "seq": seq, "digest": forged.digest}
                for r in rows
                if r["call_id"] == source.call_id
            ]
            return rows + extra

        _rows(w, "calls", add)


def delete_record_and_events(w: Written, call_id: str) -> None:
    if w.kind == "sqlite":
        _sql(
            w,
            ("DELETE FROM calls WHERE call_id = ?", (call_id,)),
            ("DELETE FROM events WHERE call_id = ?", (call_id,)),
        )
    else:
        _rows(w, "calls", lambda rows: [r for r in rows if r["call_id"] != call_id])
        _rows(w, "ledger", lambda rows: [r for r in rows if not _event_of(r, call_id)])
        for claim in (w.where / "claims").rglob("*"):
            if claim.is_file() and call_id.encode() in claim.read_bytes():
                claim.unlink()


def delete_events(w: Written, keep: Callable[[int, str], bool]) -> None:
    """Delete the events of ``ep`` that `keep(position, kind)` does not keep."""
    if w.kind == "sqlite":
        with sqlite3.connect(w.where) as db:
            rows = db.execute("SELECT position, kind FROM events WHERE rollout_id = 'ep'")
            for position, kind in list(rows):
                if not keep(position, kind):
                    db.execute(
                        "DELETE FROM events WHERE rollout_id = 'ep' AND position = ?", (position,)
                    )
        db.close()
    else:
        _rows(
            w,
            "ledger",
            lambda rows: [
                r for r in rows if not (_event_of(r) and not keep(r["position"], r["event_kind"]))
            ],
        )


def positions(w: Written) -> dict[str, list[int]]:
    """The positions of ``ep``'s events, by kind."""
    with open_store(w.url) as store:
        out: dict[str, list[int]] = {}
        for e in store.source.events("ep"):
            out.setdefault(e.kind, []).append(e.position)
        return out


def edit_header_metadata(w: Written, old: bytes, new: bytes) -> None:
    if w.kind == "sqlite":
        _sql(
            w,
            (
                "UPDATE rollouts SET metadata = replace(metadata, ?, ?) WHERE id = 'ep'",
                (old.decode(), new.decode()),
            ),
        )
    else:

        def edit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
            for r in rows:
                if r["kind"] == "rollout" and r["rollout_id"] == "ep":
                    r["metadata"] = r["metadata"].replace(old, new)
            return rows

        _rows(w, "ledger", edit)


# -- every trainer-facing read -------------------------------------------------------------------


def assert_refused_everywhere(w: Written, tmp_path: Path, *, why: str) -> None:
    """``ep`` is refused by every trainer-facing read, with a problem that says `why`; ``ok``
    is read as before."""
    with open_store(w.url) as store:
        with pytest.raises(StoreCorrupted) as corrupted:
            store.verify()
        mine = [p.message for p in corrupted.value.problems if p.key == "rollout:ep"]
        assert any(why in m for m in mine), mine
        assert not [p for p in corrupted.value.problems if p.key == "rollout:ok"]
        for read in (store.calls, store.trajectory):
            with pytest.raises(RolloutExcluded) as refused:
                read("ep")
            assert refused.value.keyword in ("verify", "include_poisoned")
        with pytest.raises(RolloutExcluded, match="does not verify"):
            store.trajectory("ep", include_poisoned=True)
        skipped: dict[str, list[str]] = {}
        assert [t.rollout_id for t in store.iter_trajectories(skipped=skipped)] == ["ok"]
        assert "ep" in skipped.get("unverified", []) + skipped.get("poisoned", [])
        took = [t.rollout_id for t in store.iter_trajectories(include_poisoned=True)]
        assert took == ["ok"]
        assert store.trajectory("ok").calls  # the untouched rollout reads as before
    out = io.StringIO()
    assert inspect_main([w.url, "--verify"], stdout=out) == 1
    assert why in out.getvalue()
    summary = export_store(w.url, str(tmp_path / "x.parquet"), include_poisoned=True)
    assert summary.left_out["unverified"] == ["ep"]
    assert any(why in p for p in summary.unverified["ep"])
    assert set(pq.read_table(tmp_path / "x.parquet")["rollout_id"].to_pylist()) == {"ok"}
    assert cli_main(["export", w.url, str(tmp_path / "y.parquet"), "--include-poisoned"]) == 1


# -- the cases -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_an_untouched_store_verifies_and_reads_whole(kind: str, tmp_path: Path) -> None:
    w = await write(kind, tmp_path)
    with open_store(w.url) as store:
        store.verify()
        assert [t.rollout_id for t in store.iter_trajectories()] == ["ep", "ok"]
        assert store.trajectory("ep").reward == 0.1
    assert inspect_main([w.url, "--verify"], stdout=io.StringIO()) == 0
    assert cli_main(["export", w.url, str(tmp_path / "x.parquet")]) == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_the_last_record_deleted_with_its_events_is_refused(
    kind: str, tmp_path: Path
) -> None:
    w = await write(kind, tmp_path)
    delete_record_and_events(w, w.records[-1].call_id)
    assert_refused_everywhere(w, tmp_path, why="event log broken at position 4")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_duplicate_seq_with_a_recomputed_digest_is_refused(
    kind: str, tmp_path: Path
) -> None:
    w = await write(kind, tmp_path)
    copy_record(w, w.records[1], "forged", w.records[1].seq)
    assert_refused_everywhere(w, tmp_path, why="seq 1 is held by 2 calls")


@pytest.mark.parametrize("kind", KINDS)
async def test_the_event_log_deleted_with_a_ledger_row_is_refused(
    kind: str, tmp_path: Path
) -> None:
    w = await write(kind, tmp_path, poisoned=True)
    with open_store(w.url) as store:
        assert store.status("ep").poisoned
    if kind == "sqlite":
        _sql(
            w,
            ("DELETE FROM events WHERE rollout_id = 'ep'", ()),
            ("DELETE FROM failures WHERE rollout_id = 'ep'", ()),
        )
    else:

        def drop(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
            kept = [r for r in rows if not (_event_of(r) or r["kind"] == "failure")]
            for r in kept:
                if r["kind"] == "rollout" and r["rollout_id"] == "ep":
                    r["poisoned"] = False
            return kept

        _rows(w, "ledger", drop)
        for claim in (w.where / "claims").rglob("*"):
            if claim.is_file() and b'"ep"' in claim.read_bytes():
                claim.unlink()
    with open_store(w.url) as store:
        assert not store.status("ep").poisoned  # un-poisoned: only the check refuses it now
    assert_refused_everywhere(w, tmp_path, why="a staged record no event of the log names")


@pytest.mark.parametrize("kind", KINDS)
async def test_the_tail_cut_through_the_seal_is_refused(kind: str, tmp_path: Path) -> None:
    w = await write(kind, tmp_path)
    last = w.records[-1]
    delete_record_and_events(w, last.call_id)
    cut_from = min(positions(w)["outcome"])  # what is left is a chain that holds
    delete_events(w, lambda position, _: position < cut_from)
    with open_store(w.url) as store:
        assert store.status("ep").state is RolloutState.SEALED
    assert_refused_everywhere(w, tmp_path, why="its header says sealed; its event log has no seal")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_record_no_event_names_is_refused(kind: str, tmp_path: Path) -> None:
    w = await write(kind, tmp_path)
    copy_record(w, w.records[-1], "extra", 3)
    assert_refused_everywhere(
        w, tmp_path, why="seq 3 (call extra): a staged record no event of the log names"
    )


@pytest.mark.parametrize("kind", KINDS)
async def test_the_headers_reward_edited_after_the_seal_is_refused(
    kind: str, tmp_path: Path
) -> None:
    w = await write(kind, tmp_path)
    edit_header_metadata(w, b"0.1", b"0.9")
    with open_store(w.url) as store:
        assert store.status("ep").outcome.reward == 0.9  # type: ignore[union-attr]
    assert_refused_everywhere(w, tmp_path, why="its header's outcome (reward 0.9")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_deleted_seal_event_is_refused(kind: str, tmp_path: Path) -> None:
    w = await write(kind, tmp_path)
    (seal,) = positions(w)["seal"]
    delete_events(w, lambda position, _: position != seal)  # the last event: the chain holds
    assert_refused_everywhere(w, tmp_path, why="its header says sealed; its event log has no seal")


async def test_an_open_crashed_rollout_on_parquet_is_not_read_as_clean(tmp_path: Path) -> None:
    """A proxy killed with a call in flight leaves the call's claim file and nothing else (its
    event commits with the next unit, which never came): the rollout is open and poisoned
    (``lost_in_crash``), and no default read takes it. With the claim file deleted too, the
    rollout is still open: no default read takes it either (an anchored read needs the seal
    answer, which a crashed rollout never had), and the store head its writer published after
    the claim catches the deletion (tests/read/test_store_head_claims.py)."""
    where = tmp_path / "ds"
    sink = ParquetSink(str(where))
    session = Session("ep")
    first, second = session.next()[0], session.next()[0]
    await _call(sink, first)
    await sink.append_event(claim_event("ep", second.seq, second.call_id, 2))
    # Read as the store is after SIGKILL here: the claim file is there, its event is not (it
    # commits with the next unit, or at close, which a killed proxy never reaches).
    url = f"parquet:///{where}"
    try:
        with open_store(url) as store:
            status = store.status("ep")
            assert status.poisoned
            assert status.state is RolloutState.OPEN
            assert [n.status for n in status.not_staged] == ["lost_in_crash"]
            for read in (store.calls, store.trajectory):
                with pytest.raises(RolloutExcluded, match="poisoned"):
                    read("ep", include_open=True)
            skipped: dict[str, list[str]] = {}
            assert list(store.iter_trajectories(include_open=True, skipped=skipped)) == []
            assert skipped["poisoned"] == ["ep"]
        for claim in (where / "claims").rglob("*"):
            if claim.is_file() and second.call_id.encode() in claim.read_bytes():
                claim.unlink()
        with open_store(url) as store:
            with pytest.raises(RolloutExcluded, match="is open"):
                store.trajectory("ep")
            skipped = {}
            assert list(store.iter_trajectories(skipped=skipped)) == []
            assert skipped["open"] == ["ep"]
        summary = export_store(url, str(tmp_path / "x.parquet"))
        assert (summary.rollouts, summary.left_out["open"]) == (0, ["ep"])
    finally:
        await sink.close()
