"""What the trainer adapters hand over, checked by the trainers' own code: verl's
`AgentLoopOutput` and GRPO advantage, SkyRL's `validate_generator_output`, run in the cached
trainers' venv (scripts/trainer_env.py) on rollouts staged through a real proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from capture_proxy import open_store
from capture_proxy.read.trainers import Episode, episodes, to_skyrl, to_verl
from tests.support.trainer_rollouts import (
    IMAGE_SIZE,
    OUTCOMES,
    TrainerRefused,
    png,
    run_check,
    run_checks,
    stage_rollouts,
)

pytestmark = pytest.mark.trainers


@pytest.fixture
async def batch(tmp_path: Path) -> list[Episode]:
    url = await stage_rollouts(tmp_path)
    with open_store(url) as store:
        return list(episodes(store))


def test_verl_takes_every_segment_and_groups_by_uid(batch: list[Episode]) -> None:
    samples = to_verl(batch)
    # t1-a and t1-b drifted once (2 segments each); t2-a and t2-b are one segment each.
    assert [s["key"] for s in samples] == [
        "task-1_0_0",
        "task-1_0_1",
        "task-1_1_0",
        "task-1_1_1",
        "task-2_0_0",
        "task-2_1_0",
    ]
    seen = run_check("verl", samples)
    assert seen["n_outputs"] == 6
    # The reward is given once per rollout: on its last segment (verl copies it to the others).
    assert seen["scored"] == [False, True, False, True, True, True]
    assert seen["final_keys"] == ["task-1_0_1", "task-1_1_1", "task-2_0_0", "task-2_1_0"]
    # The object reward {"pass": 1.0, "style": 0.5} is their sum.
    assert seen["final_scores"] == [1.5, 0.0, 1.0, 0.25]
    # GRPO in each uid group: the better rollout of two gets +1/sqrt(2), the other -1/sqrt(2).
    assert seen["advantages"] == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-3)
    # The image reaches verl as pixels (the PNG's 56x28), which a VL image processor takes.
    assert seen["image_pixels"] == [[IMAGE_SIZE[0] * IMAGE_SIZE[1]]]
    ((grid,),) = seen["image_grids"]
    assert grid[0] == 1  # one frame (t) of h x w patches
    (with_image,) = [s for s in samples if s["output"]["multi_modal_data"]]
    assert with_image["output"]["multi_modal_data"]["images"] == [{"bytes": png()}]
    last = samples[1]["output"]
    assert last["extra_fields"]["reward_extra_info"] == {"pass": 1.0, "style": 0.5}
    assert last["num_turns"] == 6  # 3 calls: 3 assistant + 2 user/tool turns + 1


def test_verl_refuses_the_old_loader_shape(batch: list[Episode]) -> None:
    old = to_verl(batch)
    for sample in old:  # what docs/trajectories.md's loader gave: no metrics, "image" bytes
        del sample["output"]["metrics"]
    with pytest.raises(TrainerRefused, match=r"ValidationError: .*metrics\s+Field required"):
        run_check("verl", old)


def test_skyrl_validates_the_step_wise_output(batch: list[Episode]) -> None:
    sky = to_skyrl(batch)
    assert sky.step_wise
    assert sky.num_prompts == 4
    seen = run_check(
        "skyrl", {"output": sky.output, "num_prompts": sky.num_prompts, "step_wise": True}
    )
    assert seen["n_rows"] == 6
    assert seen["trajectory_ids"] == [
        "task-1_0",
        "task-1_0",
        "task-1_1",
        "task-1_1",
        "task-2_0",
        "task-2_1",
    ]
    out = sky.output
    assert out["is_last_step"] == [False, True, False, True, True, True]
    assert out["rewards"] == [0.0, 1.5, 0.0, 0.0, 1.0, 0.25]
    # A tool-call turn is not truncated; the real `max_tokens` cut is: SkyRL's own overlong
    # filter drops that row only.
    assert out["stop_reasons"] == ["stop", "stop", "stop", "stop", "stop", "length"]
    assert seen["overlong_dropped"] == [False] * 5 + [True]
    assert out["rollout_metrics"]["capture_proxy/length_cut"] == 1
    finish = [m["finish_reason"] for m in out["env_metrics"]]
    assert finish == ["tool_calls", "stop", "tool_calls", "stop", "stop", "length"]


def test_skyrl_refuses_segments_without_step_wise_and_takes_single_segments(
    batch: list[Episode],
) -> None:
    sky = to_skyrl(batch)
    old: dict[str, Any] = {**sky.output, "is_last_step": None}
    single = to_skyrl([e for e in batch if e.trajectory.group_id == "task-2"])
    assert not single.step_wise
    flat, unmarked, taken = run_checks(
        ("skyrl", {"output": old, "num_prompts": 4, "step_wise": False}),
        ("skyrl", {"output": old, "num_prompts": 4, "step_wise": True}),
        ("skyrl", {"output": single.output, "num_prompts": 2, "step_wise": False}),
    )
    # The old shape (one row per segment, no step-wise marks), refused by SkyRL's own validator.
    assert isinstance(flat, TrainerRefused)
    assert "Mismatch between prompts (4) and responses (6)" in str(flat)
    assert isinstance(unmarked, TrainerRefused)
    assert "`is_last_step` is missing" in str(unmarked)
    assert not isinstance(taken, TrainerRefused)
    assert taken["n_rows"] == 2
    with pytest.raises(ValueError, match="several segments"):
        to_skyrl(batch, step_wise=False)


def test_every_rollout_is_graded_as_staged(batch: list[Episode]) -> None:
    assert {e.trajectory.rollout_id: e.trajectory.group_id for e in batch} == {
        r: o["group_id"] for r, o in OUTCOMES.items()
    }
