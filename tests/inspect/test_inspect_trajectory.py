"""`inspect --rollout` shows what a trainer reads of the rollout: its trajectory's state,
poisoning, not-staged calls and segment breaks, for open and poisoned rollouts too."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import orjson
import pytest

from capture_proxy.inspect.cli import main
from tests.read.test_rollout_status import lost_middle_call
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
