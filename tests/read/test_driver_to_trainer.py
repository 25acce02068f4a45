"""The path a training job takes, end to end on a served proxy: the driver creates rollouts,
sandboxes call the model, the driver seals each rollout and reports its outcome, the trainer
exports segments and reads them with the reward attached (README, "From rollout to trainer")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from capture_proxy.read.export import export_store
from capture_proxy.sinks.registry import open_sink
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user

TOKEN = "0123456789abcdef0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
TOOL = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_graded_group_reaches_the_trainer_as_segments_with_rewards(
    kind: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/ds"
    p = await start_proxy(tmp_path, sink=open_sink(url), admin_token=TOKEN)
    rewards = {"ep-a": 1.0, "ep-b": 0.0}
    try:
        for rollout_id in rewards:
            created = await p.client.post(
                "/admin/rollouts", json={"rollout_id": rollout_id}, headers=ADMIN
            )
            assert created.status == 201, await created.text()
            answer = await p.chat(chat_body(user("list files"), tools=[TOOL]), rollout=rollout_id)
            assert answer.headers["X-Capture-Status"] == "staged"
        for rollout_id, reward in rewards.items():
            sealed = await p.client.post(f"/admin/rollouts/{rollout_id}/seal", headers=ADMIN)
            assert sealed.status == 200
            graded = await p.client.put(
                f"/admin/rollouts/{rollout_id}/outcome",
                json={"reward": reward, "group_id": "prompt-7"},
                headers=ADMIN,
            )
            assert graded.status == 200, await graded.text()
    finally:
        await stop_proxy(p)

    out = tmp_path / "segments.parquet"
    summary = export_store(url, str(out), per="segment")
    assert summary.rows == 2
    rows: list[dict[str, Any]] = pq.read_table(out).to_pylist()
    assert [(r["rollout_id"], r["group_id"], r["reward"]) for r in rows] == [
        ("ep-a", "prompt-7", 1.0),
        ("ep-b", "prompt-7", 0.0),
    ]
    for row in rows:
        assert row["state"] == "sealed"
        assert row["poisoned"] is False
        assert row["prompt_ids"]
        assert row["response_ids"]
        assert len(row["response_mask"]) == len(row["response_ids"])
        assert sum(row["response_mask"]) > 0
