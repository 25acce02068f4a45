"""`capture-proxy export` leaves out open and poisoned rollouts by default and says so;
`capture-proxy seal` seals rollouts offline and is refused while a writer holds the store.
Both stores (SQLite file, Parquet dataset), run in-process through `main`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from capture_proxy.cli import main
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.base import StagingSink
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.read.test_rollout_status import lost_middle_call
from tests.support.sink_factories import Session


def open_writer(kind: str, tmp_path: Path) -> tuple[str, StagingSink]:
    if kind == "sqlite":
        path = tmp_path / "capture.db"
        return f"sqlite:///{path}", SQLiteSink(str(path))
    return f"parquet:///{tmp_path / 'ds'}", ParquetSink(str(tmp_path / "ds"))


async def three_rollouts(kind: str, tmp_path: Path) -> str:
    """``done`` (to be sealed), ``running`` (open) and ``bad`` (a call answered, not staged)."""
    url, sink = open_writer(kind, tmp_path)
    for rollout_id in ("done", "running"):
        s = Session(rollout_id)
        for _ in range(2):
            await sink.stage(s.next()[0])
    await lost_middle_call(sink, "bad")
    await sink.close()
    return url


async def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    # On a thread: `seal` runs its own event loop.
    code = await asyncio.to_thread(main, argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
@pytest.mark.parametrize("per", ["call", "trajectory"])
async def test_export_leaves_out_open_and_poisoned_rollouts_and_says_so(
    kind: str, per: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await three_rollouts(kind, tmp_path)
    out = tmp_path / "out.parquet"
    # A first run without a control API: nothing is sealed, so nothing is exported, and the
    # summary names the flag and the command that fix it.
    code, text, err = await run(["export", url, str(out), "--per", per], capsys)
    assert code == 0
    assert text.startswith("wrote 0 row(s) of 0 rollout(s)")
    assert "left out 3 rollout(s): 2 open" in err
    assert "--include-open" in err
    assert "capture-proxy seal" in err
    assert "1 poisoned" in err
    assert "--include-poisoned" in err

    code, text, _ = await run(["seal", url, "done"], capsys)
    assert (code, text) == (0, "done: sealed\n")
    code, text, err = await run(["export", url, str(out), "--per", per, "--json"], capsys)
    assert code == 0
    summary = json.loads(text)
    assert summary["rollouts"] == 1
    assert summary["left_out"] == {"open": ["running"], "poisoned": ["bad"], "unverified": []}
    rows = pq.read_table(out).to_pylist()
    assert {(r["rollout_id"], r["state"], r["poisoned"], r["n_failures"]) for r in rows} == {
        ("done", "sealed", False, 0)
    }

    flags = ["--include-open", "--include-poisoned", "--no-verify", "--json"]
    code, text, err = await run(["export", url, str(out), "--per", per, *flags], capsys)
    assert (code, err) == (0, "")
    assert json.loads(text)["left_out"] == {"open": [], "poisoned": [], "unverified": []}
    rows = pq.read_table(out).to_pylist()
    got = {(r["rollout_id"], r["state"], r["poisoned"], r["n_failures"]) for r in rows}
    assert got == {
        ("done", "sealed", False, 0),
        ("running", "open", False, 0),
        ("bad", "open", True, 1),
    }
    if per == "trajectory":
        (bad,) = [r for r in rows if r["rollout_id"] == "bad"]
        assert [b["reason"] for b in bad["breaks"]] == ["not_staged"]
        assert [n["status"] for n in bad["not_staged"]] == ["capture_failed"]


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_seal_writes_the_state_into_the_store(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await three_rollouts(kind, tmp_path)
    code, text, _ = await run(["seal", url, "done", "running"], capsys)
    assert (code, text) == (0, "done: sealed\nrunning: sealed\n")
    with open_store(url) as store:
        assert store.rollout_info("done").state is RolloutState.SEALED
        assert store.rollout_info("done").sealed_at_ms is not None
        assert store.rollout_info("bad").state is RolloutState.OPEN
        assert len(store.calls("running")) == 2
    code, text, _ = await run(["seal", url, "done"], capsys)
    assert (code, text) == (0, "done: already sealed\n")


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_sealing_offline_keeps_the_rollouts_outcomes(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await three_rollouts(kind, tmp_path)
    graded = RolloutOutcome(reward=1.0, group_id="g", at_ms=5)
    _, sink = open_writer(kind, tmp_path)
    with open_store(url) as store:
        header = store.rollout_info("done")
    await sink.put_rollout(
        RolloutInfo("done", header.state, False, header.created_at_ms, None, {}, {}, (graded,))
    )
    await sink.close()
    code, _, _ = await run(["seal", url, "done"], capsys)
    assert code == 0
    with open_store(url) as store:
        info = store.rollout_info("done")
        assert (info.state, info.outcome_history) == (RolloutState.SEALED, (graded,))


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_seal_is_refused_while_a_writer_holds_the_store(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await three_rollouts(kind, tmp_path)
    _, sink = open_writer(kind, tmp_path)  # a running proxy holds its sink's writer lock
    try:
        code, text, err = await run(["seal", url, "done"], capsys)
    finally:
        await sink.close()
    assert (code, text) == (1, "")
    assert err.startswith("capture-proxy seal: another ")
    assert "POST /admin/rollouts/ROLLOUT/seal" in err
    with open_store(url) as store:
        assert store.rollout_info("done").state is RolloutState.OPEN


async def test_seal_of_a_missing_rollout_or_store_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await three_rollouts("sqlite", tmp_path)
    code, _, err = await run(["seal", url, "done", "nope"], capsys)
    assert code == 1
    assert err == f"capture-proxy seal: no rollout 'nope' in {url}: nothing sealed\n"
    with open_store(url) as store:
        assert store.rollout_info("done").state is RolloutState.OPEN  # all or nothing
    missing = tmp_path / "missing.db"
    code, _, err = await run(["seal", f"sqlite:///{missing}", "x"], capsys)
    assert code == 1
    assert err.startswith("capture-proxy seal: ")
    assert not missing.exists()
