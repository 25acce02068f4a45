"""An anchor a driver keeps: the seal and outcome answers carry the rollout's chain head, and
anchored reads (`trajectory(expected_head=)`, `iter_trajectories(expected_heads=)`,
`export_store(expected_heads=)`, ``export --expected-heads``) refuse a rollout whose stored
chain ends elsewhere: a consistent rewrite (events rehashed from the public spec), which every
un-anchored check passes, included."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from capture_proxy.cli import main as cli_main
from capture_proxy.read.anchors import AnchorsInvalid, heads_of, load_heads
from capture_proxy.read.export import export_store
from capture_proxy.read.integrity import RolloutUnverified
from capture_proxy.read.reader import open_store
from capture_proxy.read.trainers import episodes, read_episode
from capture_proxy.schemas.events import RolloutEvent, chain_head, event_hash
from tests.read.test_tamper import (
    KINDS,
    Rows,
    Written,
    _event_of,
    _rows,
    edit_header_metadata,
    write,
)
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


async def test_the_seal_and_outcome_answers_carry_the_chain_head(tmp_path: Path) -> None:
    p = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        for text in ("one", "two"):
            resp = await p.chat(chat_body(user(text)), rollout="ep")
            assert resp.headers["X-Capture-Status"] == "staged"
        sealed = await (await p.client.post("/admin/rollouts/ep/seal", headers=ADMIN)).json()
        with open_store(p.store_url) as store:
            events = store.source.events("ep")
            assert sealed["chain_head"] == chain_head(events) == events[-1].hash
            assert events[-1].kind == "seal"
        resp = await p.client.put("/admin/rollouts/ep/outcome", json={"reward": 1}, headers=ADMIN)
        graded = await resp.json()
        assert graded["chain_head"] != sealed["chain_head"]
        with open_store(p.store_url) as store:
            assert graded["chain_head"] == chain_head(store.source.events("ep"))
            # The last answer kept is the anchor: the rollout reads, anchored by it.
            traj = store.trajectory("ep", expected_head=graded["chain_head"])
            assert traj.reward == 1.0
            with pytest.raises(RolloutUnverified, match="its driver kept"):
                store.trajectory("ep", expected_head=sealed["chain_head"])
        kept = tmp_path / "answers.jsonl"
        kept.write_bytes(orjson.dumps(sealed) + b"\n" + orjson.dumps(graded) + b"\n")
        assert load_heads(str(kept)) == {"ep": graded["chain_head"]}
        assert (
            cli_main(
                ["export", p.store_url, str(tmp_path / "x.parquet"), "--expected-heads", str(kept)]
            )
            == 0
        )
    finally:
        await stop_proxy(p)


def _rehash(w: Written, edit: Any) -> None:
    """Rewrite ``ep``'s event log from the public spec: `edit(events)` returns the events to
    keep (bodies edited as wished), which are then renumbered and rehashed."""
    with open_store(w.url) as store:
        old = store.source.events("ep")
    kept: list[RolloutEvent] = edit(list(old))
    new: list[RolloutEvent] = []
    for i, e in enumerate(kept):
        prev = new[-1].hash if new else ""
        h = event_hash(e.rollout_id, i, e.kind, e.seq, e.call_id, e.at_ms, e.body, prev)
        new.append(replace(e, position=i, prev_hash=prev, hash=h))
    if w.kind == "sqlite":
        with sqlite3.connect(w.where) as db:
            db.execute("DELETE FROM events WHERE rollout_id = 'ep'")
            db.executemany(
                "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        e.rollout_id,
                        e.position,
                        e.kind,
                        e.seq,
                        e.call_id,
                        e.at_ms,
                        orjson.dumps(dict(e.body)).decode(),
                        e.prev_hash,
                        e.hash,
                    )
                    for e in new
                ],
            )
        db.close()
        return
    by_hash = {o.hash: n for o, n in zip(kept, new, strict=True)}

    def rewrite(rows: Rows) -> Rows:
        out = []
        for r in rows:
            if not _event_of(r):
                out.append(r)
            elif r["hash"] in by_hash:
                e = by_hash[r["hash"]]
                out.append(
                    {
                        **r,
                        "position": e.position,
                        "prev_hash": e.prev_hash,
                        "hash": e.hash,
                        "body": orjson.dumps(dict(e.body)),
                    }
                )
        return out

    _rows(w, "ledger", rewrite)


def _reward(events: list[RolloutEvent]) -> list[RolloutEvent]:
    return [
        replace(e, body={**e.body, "reward": 0.9}) if e.kind == "outcome" else e for e in events
    ]


async def _consistently_rewritten(kind: str, tmp_path: Path) -> tuple[Written, dict[str, str]]:
    w = await write(kind, tmp_path)
    with open_store(w.url) as store:
        heads = {r: chain_head(store.source.events(r)) or "" for r in ("ep", "ok")}
    edit_header_metadata(w, b"0.1", b"0.9")
    _rehash(w, _reward)
    with open_store(w.url) as store:
        store.verify()  # consistent: every un-anchored check passes
        assert store.trajectory("ep").reward == 0.9
    return w, heads


@pytest.mark.parametrize("kind", KINDS)
async def test_a_consistent_rewrite_is_refused_by_every_anchored_read(
    kind: str, tmp_path: Path
) -> None:
    w, heads = await _consistently_rewritten(kind, tmp_path)
    with open_store(w.url) as store:
        with pytest.raises(RolloutUnverified, match="its driver kept"):
            store.trajectory("ep", expected_head=heads["ep"])
        assert store.check("ep", expected_head=heads["ep"])
        skipped: dict[str, list[str]] = {}
        took = [
            t.rollout_id for t in store.iter_trajectories(expected_heads=heads, skipped=skipped)
        ]
        assert took == ["ok"]
        assert skipped["unverified"] == ["ep"]
        # The trainer adapters' reads are anchored alike.
        with pytest.raises(RolloutUnverified, match="its driver kept"):
            read_episode(store, "ep", expected_head=heads["ep"])
        why: dict[str, list[str]] = {}
        handed = [
            e.trajectory.rollout_id for e in episodes(store, expected_heads=heads, unverified=why)
        ]
        assert handed == ["ok"]
        assert list(why) == ["ep"]
    summary = export_store(w.url, str(tmp_path / "x.parquet"), expected_heads=heads)
    assert summary.left_out["unverified"] == ["ep"]
    assert set(pq.read_table(tmp_path / "x.parquet")["rollout_id"].to_pylist()) == {"ok"}
    kept = tmp_path / "heads.json"
    kept.write_text(json.dumps([{"rollout_id": r, "chain_head": h} for r, h in heads.items()]))
    assert (
        cli_main(["export", w.url, str(tmp_path / "y.parquet"), "--expected-heads", str(kept)]) == 1
    )


@pytest.mark.parametrize("kind", KINDS)
async def test_a_consistent_truncation_is_refused_by_an_anchored_read(
    kind: str, tmp_path: Path
) -> None:
    w = await write(kind, tmp_path)
    last = w.records[-1]
    with open_store(w.url) as store:
        heads = {r: chain_head(store.source.events(r)) or "" for r in ("ep", "ok")}
    if kind == "sqlite":
        with sqlite3.connect(w.where) as db:
            db.execute("DELETE FROM calls WHERE call_id = ?", (last.call_id,))
        db.close()
    else:
        _rows(w, "calls", lambda rows: [r for r in rows if r["call_id"] != last.call_id])
        for claim in (w.where / "claims").rglob("*"):
            if claim.is_file() and last.call_id.encode() in claim.read_bytes():
                claim.unlink()
    _rehash(w, lambda events: [e for e in events if e.call_id != last.call_id])
    with open_store(w.url) as store:
        store.verify()
        assert len(store.trajectory("ep").calls) == 2
        skipped: dict[str, list[str]] = {}
        assert [
            t.rollout_id for t in store.iter_trajectories(expected_heads=heads, skipped=skipped)
        ] == ["ok"]
        assert skipped["unverified"] == ["ep"]


async def test_an_anchored_read_names_the_rollouts_the_store_lost_and_the_ones_not_anchored(
    tmp_path: Path,
) -> None:
    w = await write("sqlite", tmp_path)
    with open_store(w.url) as store:
        heads = {"ep": chain_head(store.source.events("ep")) or "", "gone": "0" * 64}
        skipped: dict[str, list[str]] = {}
        assert [
            t.rollout_id for t in store.iter_trajectories(expected_heads=heads, skipped=skipped)
        ] == ["ep"]
        assert (skipped["missing"], skipped["unanchored"]) == (["gone"], ["ok"])
    summary = export_store(w.url, str(tmp_path / "x.parquet"), expected_heads=heads)
    assert (summary.left_out["missing"], summary.left_out["unanchored"]) == (["gone"], ["ok"])
    kept = tmp_path / "heads.jsonl"
    kept.write_text(
        "".join(json.dumps({"rollout_id": r, "chain_head": h}) + "\n" for r, h in heads.items())
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(
            ["export", w.url, str(tmp_path / "y.parquet"), "--expected-heads", str(kept)]
        )
    assert code == 1
    assert "1 anchored but not in the store (gone)" in err.getvalue()


def test_a_file_of_answers_that_is_not_json_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "answers.jsonl"
    bad.write_text('{"rollout_id": "a", "chain_head": "x"}\nnot json\n')
    with pytest.raises(AnchorsInvalid, match="line 2: not JSON"):
        load_heads(str(bad))
    assert heads_of([{"rollout_id": "a", "chain_head": "1"}, {"rollout_id": "a"}]) == {"a": "1"}
