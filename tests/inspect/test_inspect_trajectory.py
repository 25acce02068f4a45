"""`inspect --rollout` shows what a trainer reads of the rollout: its trajectory's state,
poisoning, not-staged calls and segment breaks, for open and poisoned rollouts too."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import orjson
import pytest

from capture_proxy.inspect.cli import main
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.events import claim_event
from capture_proxy.schemas.records import CallStatus
from tests.read.test_rollout_status import lost_middle_call
from tests.support.sink_factories import Session
from tests.test_cli_store import open_writer


def inspect(*argv: str) -> str:
    buf = io.StringIO()
    assert main(list(argv), stdout=buf) == 0
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_rollout_view_shows_poisoning_and_breaks(kind: str, tmp_path: Path) -> None:
    url, sink = open_writer(kind, tmp_path)
    first, lost, third = await lost_middle_call(sink, "p")
    await sink.close()
    boundary = len(first.prompt_token_ids) + len(first.completion_token_ids)

    view: dict[str, Any] = orjson.loads(inspect(url, "--rollout", "p", "--json"))
    traj = view["trajectory"]
    assert (traj["ok"], traj["state"], traj["poisoned"], traj["n_failures"]) == (
        True,
        "open",
        True,
        1,
    )
    assert traj["breaks"] == [
        {"call_id": third.call_id, "position": boundary, "reason": "not_staged"}
    ]
    assert traj["not_staged"] == [
        {
            "seq": lost.seq,
            "call_id": lost.call_id,
            "status": "capture_failed",
            "reason": "missing_token_ids",
        }
    ]

    text = inspect(url, "--rollout", "p")
    (line,) = [x for x in text.splitlines() if x.startswith("Trajectory")]
    assert line.startswith("Trajectory (open, POISONED, 1 not staged): ")
    assert f"breaks: not_staged at token {boundary} ({third.call_id})" in line


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_call_lost_in_a_crash_is_listed_and_poisons_as_store_status_says(
    kind: str, tmp_path: Path
) -> None:
    """A call admitted (its seq claimed) and then neither staged nor in the ledger, as a SIGKILL
    mid-call leaves it: inspect's overview, rollout view and JSON say poisoned, as
    `Store.status` does, and list the lost call as a row of its own."""
    url, sink = open_writer(kind, tmp_path)
    session = Session("p")
    first, lost = session.next()[0], session.next()[0]
    await sink.append_event(claim_event("p", first.seq, first.call_id, 1))
    assert (await sink.stage(first)).status is CallStatus.STAGED
    await sink.append_event(claim_event("p", lost.seq, lost.call_id, 2))
    await sink.close()
    with open_store(url) as store:
        status = store.status("p")
    assert status.poisoned
    assert [(n.call_id, n.status) for n in status.not_staged] == [(lost.call_id, "lost_in_crash")]

    overview: dict[str, Any] = orjson.loads(inspect(url, "--json"))
    (summary,) = overview["rollouts"]
    assert summary["poisoned"] is True
    assert summary["statuses"] == {"staged": 1, "lost_in_crash": 1}
    view: dict[str, Any] = orjson.loads(inspect(url, "--rollout", "p", "--json"))
    assert view["rollout"]["poisoned"] is True
    assert [(c["seq"], c["status"]) for c in view["calls"]] == [(0, "staged"), (1, "lost_in_crash")]
    assert view["calls"][1]["call_id"] == lost.call_id
    text = inspect(url, "--rollout", "p")
    assert f"POISONED: answered but not staged: #1 {lost.call_id} (lost_in_crash)" in text
    assert "POISONED: p" in inspect(url)
