"""SkyRL: a `GeneratorOutput`, step-wise when a rollout has several segments.

Held to SkyRL's own code: `skyrl.train.generators.base.GeneratorOutput` and `TrajectoryID`,
and `skyrl.train.utils.trainer_utils.validate_generator_output` (a956457; the same functions in
the published `skyrl` 0.3.0, which tests/read/trainers/ runs on this output).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._common import Episode, pieces, repetitions, scalar_reward

__all__ = ["SkyRLBatch", "stop_reason", "to_skyrl"]


def stop_reason(finish_reason: str) -> str:
    """SkyRL's stop reason for a call's finish reason: ``"length"`` only for a real cut by the
    token limit, ``"stop"`` for everything else. SkyRL's overlong filter and
    ``zero_reward_on_non_stop`` treat any reason but ``"stop"`` as truncated; a turn that ended
    in tool calls (``"tool_calls"``) was not."""
    return "length" if finish_reason == "length" else "stop"


@dataclass(frozen=True, slots=True)
class SkyRLBatch:
    """What SkyRL's trainer takes from a generator, and how to validate it."""

    #: The `GeneratorOutput` dict; `trajectory_ids` holds ``(instance_id, repetition_id)``
    #: pairs: make each a ``TrajectoryID(*pair)``.
    output: dict[str, Any]
    #: The number of prompts (rollouts) the output answers: `validate_generator_output`'s
    #: ``num_prompts``.
    num_prompts: int
    #: Whether the output is step-wise (one row per segment): SkyRL's
    #: ``generator.step_wise_trajectories`` and `validate_generator_output`'s ``step_wise``.
    step_wise: bool


def to_skyrl(
    episodes: Iterable[Episode],
    *,
    step_wise: bool | None = None,
    reward_component: str | None = None,
) -> SkyRLBatch:
    """The episodes as one SkyRL `GeneratorOutput`.

    Without `step_wise`, the output is step-wise exactly when some rollout has more than one
    segment (multi-segment rollouts are the normal case without token-in): one row per segment,
    the rows of a rollout adjacent, ``is_last_step`` true on its last. ``step_wise=False`` with
    such a rollout raises ValueError (one row per rollout cannot hold two sequences).

    - ``rewards``: the rollout's reward (`scalar_reward`) on its last row; 0.0 on its earlier
      steps (SkyRL computes advantages on last steps and gives them to the whole trajectory).
    - ``trajectory_ids``: ``(instance_id, repetition_id)`` per row: the rollout's group (its id
      when it has none) and its place among the group's rollouts, from 0.
    - ``stop_reasons``: `stop_reason` of each segment's last call; the finish reason itself is in
      ``env_metrics`` (one dict per row, with the rollout id, segment and break reason).
    - ``rollout_metrics``: counts of this batch, named ``capture_proxy/...``.

    Images are not mapped: SkyRL's vision fields (``pixel_values``, ``image_grid_thw``) are the
    model processor's output, computed on the trainer's side. Raises `MissingReward` for a
    rollout without a reward.
    """
    eps = list(episodes)
    split = [pieces(ep) for ep in eps]
    multi = any(len(p) > 1 for p in split)
    if step_wise is None:
        step_wise = multi
    elif not step_wise and multi:
        many = [ep.trajectory.rollout_id for ep, p in zip(eps, split, strict=True) if len(p) > 1]
        raise ValueError(
            f"rollouts {many} have several segments: SkyRL takes them step-wise only "
            "(step_wise=True, generator.step_wise_trajectories)"
        )
    rows: dict[str, list[Any]] = {
        k: []
        for k in (
            "prompt_token_ids",
            "response_ids",
            "rewards",
            "loss_masks",
            "stop_reasons",
            "rollout_logprobs",
            "trajectory_ids",
            "is_last_step",
            "env_metrics",
        )
    }
    rewards: list[float] = []
    reps = repetitions([e.trajectory for e in eps])
    for ep, parts, tid in zip(eps, split, reps, strict=True):
        traj = ep.trajectory
        reward = scalar_reward(traj, reward_component)
        rewards.append(reward)
        for piece in parts:
            rows["prompt_token_ids"].append(piece.prompt_ids)
            rows["response_ids"].append(piece.response_ids)
            rows["rewards"].append(reward if piece.last else 0.0)
            rows["loss_masks"].append(piece.response_mask)
            rows["stop_reasons"].append(stop_reason(piece.finish_reason))
            rows["rollout_logprobs"].append(piece.response_logprobs)
            rows["trajectory_ids"].append(tid)
            rows["is_last_step"].append(piece.last)
            rows["env_metrics"].append(
                {
                    "rollout_id": traj.rollout_id,
                    "segment_index": piece.index,
                    "break_reason": piece.break_reason,
                    "finish_reason": piece.finish_reason,
                    "reward_components": traj.reward_components,
                }
            )
    output: dict[str, Any] = {
        **rows,
        "rollout_metrics": {
            "capture_proxy/rollouts": len(eps),
            "capture_proxy/segments": len(rows["response_ids"]),
            "capture_proxy/length_cut": rows["stop_reasons"].count("length"),
            "capture_proxy/mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        },
        "trajectory_generation_times": None,
        "rollout_expert_indices": None,
    }
    if not step_wise:
        output["is_last_step"] = None
    return SkyRLBatch(output, len(eps), step_wise)
