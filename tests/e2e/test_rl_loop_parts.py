"""The RL loop example's refusals: what stops a step, and what the user is told.

The loop itself runs in test_rl_loop.py against a real vLLM; these show its checks fail loudly:
logprobs that do not match, an update that did not take, tokens stamped with another version, a
rollout graded without a reward, and a trainer asked to recompute what it cannot. The trainer's
two run its real script in the tiny vLLM's venv (torch, transformers): `-m vllm`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from examples.rl_loop.batch import Batch, Sample, take_batch
from examples.rl_loop.loop import TRAINER, StepReport, _check, _versions
from scripts import tiny_vllm
from tests.support.proxy_harness import chat_body, user

TOKEN = "rl-loop-parts-admin-token-0123"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def report(**changes: Any) -> StepReport:
    values: dict[str, Any] = {
        "step": 1,
        "rollouts": 4,
        "max_abs_diff": 1e-6,
        "tokens_checked": 10,
        "tokens_trained": 10,
        "tokens_guided": 0,
        "tool_calls": 0,
        "previous_weights_diff": 0.5,
        "previous_weights_outside": 0,
        "version_spans": [(1, "1")],
        "seconds": {},
    }
    return StepReport(**{**values, **changes})


def sample(**changes: Any) -> Sample:
    values: dict[str, Any] = {
        "rollout_id": "r",
        "group_id": "g",
        "reward": 1.0,
        "token_ids": [11, 12, 13, 14, 15],
        "loss_mask": [0, 0, 1, 1, 1],
        "logprobs": [0.0] * 5,
        "call_index": [0] * 5,
        "segments": [(0, 5)],
        "samplings": [{"temperature": 1.0, "logprobs_mode": "processed_logprobs"}],
        "weight_versions": [0, 0, 1, 1, 1],
        "engine_weight_versions": [None, None, "1", "1", "1"],
    }
    return Sample(**{**values, **changes})


def test_a_step_whose_logprobs_do_not_match_stops_the_loop() -> None:
    with pytest.raises(AssertionError, match=r"step 1: logprobs differ by 0\.02"):
        _check(report(max_abs_diff=0.02))


def test_a_step_whose_previous_weights_give_the_same_logprobs_stops_the_loop() -> None:
    with pytest.raises(AssertionError, match="the update did not take"):
        _check(report(previous_weights_diff=1e-6))


def test_tokens_sampled_under_another_version_stop_the_step() -> None:
    assert _versions(Batch([sample()]), 1) == [(1, "1")]
    stale = sample(engine_weight_versions=[None, None, "1", "1", "0"])
    with pytest.raises(AssertionError, match=r"step 1: sampled tokens stamped .*\(1, '0'\)"):
        _versions(Batch([sample(), stale]), 1)


async def test_a_rollout_graded_without_a_reward_is_refused_by_name(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    resp = await p.chat(chat_body(user("hi"), tools=[]), rollout="ungraded")
    assert resp.status == 200, await resp.text()
    assert (await p.client.post("/admin/rollouts/ungraded/seal", headers=ADMIN)).status == 200
    outcome = {"group_id": "g0", "metadata": {"judge": "late"}}
    put = await p.client.put("/admin/rollouts/ungraded/outcome", json=outcome, headers=ADMIN)
    assert put.status == 200, await put.text()
    with pytest.raises(ValueError, match="rollout ungraded has no numeric reward"):
        take_batch(p.store_url, "trainer", 1, wait_s=5)


def run_trainer(tmp_path: Path, batch: Batch) -> subprocess.CompletedProcess[str]:
    paths = tiny_vllm.prepare()
    batch.write(tmp_path / "batch.json")
    cmd = [str(paths.python), str(TRAINER), str(tmp_path / "batch.json")]
    cmd += ["--weights", str(paths.model), "--check-only"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.vllm
def test_the_trainer_reports_how_far_recorded_logprobs_are_from_the_model(
    tmp_path: Path,
) -> None:
    done = run_trainer(tmp_path, Batch([sample()]))  # recorded 0.0: no token is that certain
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["tokens_checked"] == 3
    assert figures["max_abs_diff"] > 1.0


@pytest.mark.vllm
def test_the_trainer_refuses_a_logprobs_mode_it_cannot_recompute(tmp_path: Path) -> None:
    raw = sample(samplings=[{"temperature": 0.7, "logprobs_mode": "raw_logprobs"}])
    done = run_trainer(tmp_path, Batch([raw]))
    assert done.returncode == 1
    assert "logprobs mode 'raw_logprobs': only processed_logprobs is recomputed" in done.stderr
    assert done.stdout == ""
