"""prime-rl / verifiers: one row per staged call, in the columns of verifiers' `ProcessedOutputs`.

Held to the field names and types of `ProcessedOutputs` (``prompt_ids``, ``prompt_mask``,
``completion_ids``, ``completion_mask``, ``completion_logprobs``, ``rewards``: one list entry per
row) in willccbb/verifiers' type reference (docs/source/api_reference.md at 8823057). The published
`verifiers` (0.4.0) needs about 25 packages of its own (sandboxes, MCP, Anthropic's SDK), so it is
not installed for the tests: tests/read/trainers/ checks the names and types only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._common import Episode, repetitions, scalar_reward

__all__ = ["to_per_call"]


def to_per_call(
    episodes: Iterable[Episode], *, reward_component: str | None = None
) -> dict[str, list[Any]]:
    """One row per call of each trajectory (its full prompt and its completion), as columns.

    ``prompt_mask`` is 0 on every prompt token and ``completion_mask`` 1 on every completion
    token (a call's completion is all generated). ``rewards`` holds the rollout's reward
    (`scalar_reward`) on its **last** call's row and 0.0 on the others, with ``is_last`` marking
    that row: compute advantages on the last rows and give every row of a rollout its rollout's.
    ``example_ids`` and ``repetitions`` group the rows (the rollout's group, else its id; its
    place in the group); ``rollout_ids``, ``call_ids`` and ``finish_reasons`` say where each row
    comes from. Raises `MissingReward` for a rollout without a reward.
    """
    eps = list(episodes)
    out: dict[str, list[Any]] = {
        k: []
        for k in (
            "prompt_ids",
            "prompt_mask",
            "completion_ids",
            "completion_mask",
            "completion_logprobs",
            "rewards",
            "is_last",
            "example_ids",
            "repetitions",
            "rollout_ids",
            "call_ids",
            "finish_reasons",
        )
    }
    for ep, (instance, repetition) in zip(
        eps, repetitions([e.trajectory for e in eps]), strict=True
    ):
        traj = ep.trajectory
        reward = scalar_reward(traj, reward_component)
        for i, call_id in enumerate(traj.calls):
            record = ep.records[call_id]
            last = i == len(traj.calls) - 1
            out["prompt_ids"].append(record.prompt_token_ids.tolist())
            out["prompt_mask"].append([0] * len(record.prompt_token_ids))
            out["completion_ids"].append(record.completion_token_ids.tolist())
            out["completion_mask"].append([1] * len(record.completion_token_ids))
            out["completion_logprobs"].append(record.completion_logprobs.tolist())
            out["rewards"].append(reward if last else 0.0)
            out["is_last"].append(last)
            out["example_ids"].append(instance)
            out["repetitions"].append(repetition)
            out["rollout_ids"].append(traj.rollout_id)
            out["call_ids"].append(call_id)
            out["finish_reasons"].append(record.finish_reason)
    return out
