"""The adapters whose trainers cannot run here, held to the field names and types of their code,
and the rules every adapter shares: one number per rollout, given once, groups kept.

NeMo RL: its package index entry is an empty placeholder, so `DatumSpec` and the rollout fields
are those of NVIDIA-NeMo/RL at 7ea279a (nemo_rl/data/interfaces.py, experience/rollouts.py,
algorithms/grpo.py). Per call: verifiers' `ProcessedOutputs` (willccbb/verifiers
8823057, docs/source/api_reference.md); the published `verifiers` needs ~25 packages of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from capture_proxy import open_store
from capture_proxy.read.cursor import ExportCursor
from capture_proxy.read.status import RolloutExcluded
from capture_proxy.read.trainers import (
    Episode,
    MissingReward,
    episodes,
    read_episode,
    scalar_reward,
    stop_reason,
    to_nemo_rl,
    to_per_call,
    to_skyrl,
    to_verl,
)
from capture_proxy.read.trajectory import Trajectory
from tests.support.trainer_rollouts import stage_rollouts

# nemo_rl/data/interfaces.py at 7ea279a: DatumSpec's required keys and their types.
DATUM_SPEC: dict[str, type | tuple[type, ...]] = {
    "message_log": list,
    "length": int,
    "extra_env_info": (dict, type(None)),
    "loss_multiplier": float,
    "idx": int,
}
# verifiers' ProcessedOutputs: one list entry per row.
PROCESSED_OUTPUTS = {
    "prompt_ids": int,
    "prompt_mask": int,
    "completion_ids": int,
    "completion_mask": int,
    "completion_logprobs": float,
}


@pytest.fixture
async def batch(tmp_path: Path) -> list[Episode]:
    url = await stage_rollouts(tmp_path)
    with open_store(url) as store:
        return list(episodes(store))


def test_nemo_rl_datums_have_datum_spec_fields_and_reward_once(batch: list[Episode]) -> None:
    data = to_nemo_rl(batch)
    assert len(data) == 6  # one datum per segment
    for datum in data:
        for key, kind in DATUM_SPEC.items():
            assert isinstance(datum[key], kind), key
        log = datum["message_log"]
        assert log[0]["role"] == "user"
        # `length`: the total length of the message tensors.
        assert datum["length"] == sum(len(m["token_ids"]) for m in log)
        for message in log:
            assert all(isinstance(t, int) for t in message["token_ids"])
            # grpo.py trains on assistant messages that carry generation_logprobs.
            if message["role"] == "assistant":
                assert len(message["generation_logprobs"]) == len(message["token_ids"])
            else:
                assert "generation_logprobs" not in message
    info = [d["extra_env_info"] for d in data]
    # t1-a's first segment is its tool-call turn; its edited history opened the second: the
    # answer, the user's new message, the answer after it (one sequence).
    assert [m["role"] for m in data[0]["message_log"]] == ["user", "assistant"]
    assert [m["role"] for m in data[1]["message_log"]] == [
        "user",
        "assistant",
        "environment",
        "assistant",
    ]
    assert [i["break_reason"] for i in info[:2]] == [None, "drift"]
    assert [i["rollout_id"] for i in info] == ["t1-a", "t1-a", "t1-b", "t1-b", "t2-a", "t2-b"]
    assert [d["total_reward"] for d in data] == [0.0, 1.5, 0.0, 0.0, 1.0, 0.25]
    assert [i["is_last_segment"] for i in info] == [False, True, False, True, True, True]
    # The rollouts of one group share `idx`; a tool-call turn is not truncated, a length cut is.
    assert [d["idx"] for d in data] == [0, 0, 0, 0, 1, 1]
    assert [d["truncated"] for d in data] == [False] * 5 + [True]
    assert info[1]["reward_components"] == {"pass": 1.0, "style": 0.5}


def test_per_call_rows_have_processed_outputs_columns(batch: list[Episode]) -> None:
    rows = to_per_call(batch)
    n = len(rows["prompt_ids"])
    assert n == 8  # t1-a, t1-b: 3 calls each; t2-a, t2-b: 1 each
    assert {len(column) for column in rows.values()} == {n}
    for key, kind in PROCESSED_OUTPUTS.items():
        assert all(isinstance(v, kind) for row in rows[key] for v in row), key
    for i in range(n):
        assert len(rows["prompt_mask"][i]) == len(rows["prompt_ids"][i])
        assert len(rows["completion_mask"][i]) == len(rows["completion_ids"][i])
        assert len(rows["completion_logprobs"][i]) == len(rows["completion_ids"][i])
        assert set(rows["completion_mask"][i]) == {1}
    assert rows["rewards"] == [0.0, 0.0, 1.5, 0.0, 0.0, 0.0, 1.0, 0.25]
    assert rows["is_last"] == [False, False, True, False, False, True, True, True]
    assert rows["example_ids"] == ["task-1"] * 6 + ["task-2"] * 2
    assert rows["repetitions"] == [0, 0, 0, 1, 1, 1, 0, 1]
    assert rows["finish_reasons"][:3] == ["tool_calls", "stop", "stop"]
    assert rows["finish_reasons"][-1] == "length"


def test_an_object_reward_is_the_sum_of_its_components_or_the_one_named(
    batch: list[Episode],
) -> None:
    (ep,) = [e for e in batch if e.trajectory.rollout_id == "t1-a"]
    traj = ep.trajectory
    assert traj.reward is None
    assert traj.reward_components == {"pass": 1.0, "style": 0.5}
    assert scalar_reward(traj) == 1.5
    assert scalar_reward(traj, "pass") == 1.0
    with pytest.raises(MissingReward, match=r"component 'speed' not found \(\['pass', 'style'\]\)"):
        scalar_reward(traj, "speed")
    # Named, the component is every adapter's reward; the components stay beside it. A rollout
    # whose reward is one number has no component of that name: it is refused, not guessed.
    samples = to_verl([ep], reward_component="pass")
    assert samples[1]["output"]["reward_score"] == 1.0
    assert samples[1]["output"]["extra_fields"]["reward_extra_info"] == {"pass": 1.0, "style": 0.5}
    with pytest.raises(MissingReward, match="rollout t1-b: reward component 'pass' not found"):
        to_skyrl(batch, reward_component="pass")


def test_a_rollout_without_a_reward_is_refused_by_name() -> None:
    ungraded = Episode(Trajectory("r-ungraded"), {})
    for adapter in (to_verl, to_skyrl, to_nemo_rl, to_per_call):
        with pytest.raises(MissingReward, match="rollout r-ungraded has no reward: send its"):
            adapter([ungraded])


def test_only_a_length_cut_is_a_truncation_for_skyrl() -> None:
    assert [stop_reason(r) for r in ("stop", "tool_calls", "length", "abort")] == [
        "stop",
        "stop",
        "length",
        "stop",
    ]


async def test_named_rollouts_are_read_with_the_reader_filters(tmp_path: Path) -> None:
    url = await stage_rollouts(tmp_path)
    with open_store(url) as store:
        (image,) = episodes(store, ["t2-a"])
        assert image.trajectory.rollout_id == "t2-a"
        assert sorted(image.records) == image.trajectory.calls
        assert read_episode(store, "t2-b").trajectory.reward == 0.25
    # An open rollout is not handed over unless asked for, as with Store.trajectory.
    await _open_rollout(tmp_path / "open")
    with open_store(f"sqlite:///{tmp_path / 'open' / 'store.db'}") as store:
        with pytest.raises(RolloutExcluded, match="include_open=True"):
            read_episode(store, "r1")
        assert read_episode(store, "r1", include_open=True).trajectory.calls


async def test_a_cursor_hands_each_sealed_rollout_over_once(tmp_path: Path) -> None:
    url = await stage_rollouts(tmp_path)
    cursor = ExportCursor()
    with open_store(url) as store:
        first = [e.trajectory.rollout_id for e in episodes(store, cursor=cursor, group="task-2")]
        rest = [e.trajectory.rollout_id for e in episodes(store, cursor=cursor)]
        again = list(episodes(store, cursor=cursor))
    assert (first, rest, again) == (["t2-a", "t2-b"], ["t1-a", "t1-b"], [])


async def _open_rollout(tmp_path: Path) -> None:
    from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user

    p = await start_proxy(tmp_path)
    try:
        answer: Any = await p.chat(chat_body(user("hi")), rollout="r1")
        assert answer.status == 200
    finally:
        await stop_proxy(p)
