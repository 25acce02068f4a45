"""NeMo RL: one `DatumSpec`-shaped dict per segment, with the rollout results NeMo's GRPO reads.

NeMo RL's package index entry (`nemo-rl`) is an empty 0.0.0 placeholder, so nothing of it can run
here: the shape is held to the field names and types of NVIDIA-NeMo/RL at 7ea279a —
`nemo_rl/data/interfaces.py` (`DatumSpec`: `message_log`, `length`, `extra_env_info`,
`loss_multiplier`, `idx`), `nemo_rl/experience/rollouts.py` (messages with `role`, `token_ids`
and, for generated ones, `generation_logprobs`; the batch's `total_reward` and `truncated`) and
`nemo_rl/algorithms/grpo.py` (a message is trained on when its role is ``assistant`` and it has
`generation_logprobs`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from ._common import Episode, pieces, repetitions, scalar_reward

__all__ = ["to_nemo_rl"]


def to_nemo_rl(
    episodes: Iterable[Episode], *, reward_component: str | None = None
) -> list[dict[str, Any]]:
    """One NeMo RL datum per segment of each episode, in order.

    - ``message_log``: the segment as messages of plain token id lists (make each a tensor with
      ``torch.tensor(ids)``): first ``{"role": "user", "token_ids"}`` (the prompt up to the first
      generated token), then the response split where the loss mask changes: generated runs are
      ``{"role": "assistant", "token_ids", "generation_logprobs"}``, the runs between them (tool
      output, template tokens, a new user message) ``{"role": "environment", "token_ids"}``.
      Messages carry no ``content`` text: the token ids are what was sampled.
    - ``length``: the segment's token count; ``loss_multiplier``: 1.0; ``idx``: the group's
      number in this batch (0, 1, ... in order of first appearance; a rollout without a group is
      a group of one), so the rollouts of one prompt share it.
    - ``total_reward``: the rollout's reward (`scalar_reward`) on its last segment, 0.0 on the
      others (NeMo RL has no step-wise mode: compute each group's baseline on the last segments,
      ``extra_env_info["is_last_segment"]``, and give each segment its rollout's advantage).
    - ``truncated``: the segment's last call was cut by the token limit (``length``); a turn that
      ended in tool calls is not truncated.
    - ``extra_env_info``: rollout id, group, repetition, segment, break and finish reasons, the
      reward and its components.

    Raises `MissingReward` for a rollout without a reward.
    """
    eps = list(episodes)
    numbers: dict[str, int] = {}
    data: list[dict[str, Any]] = []
    for ep, (instance, repetition) in zip(
        eps, repetitions([e.trajectory for e in eps]), strict=True
    ):
        traj = ep.trajectory
        reward = scalar_reward(traj, reward_component)
        idx = numbers.setdefault(instance, len(numbers))
        parts = pieces(ep)
        for piece in parts:
            log: list[dict[str, Any]] = [{"role": "user", "token_ids": piece.prompt_ids}]
            at = 0
            for generated, run in itertools.groupby(piece.response_mask):
                n = len(list(run))
                ids = piece.response_ids[at : at + n]
                if generated:
                    lps = piece.response_logprobs[at : at + n]
                    log.append({"role": "assistant", "token_ids": ids, "generation_logprobs": lps})
                else:
                    log.append({"role": "environment", "token_ids": ids})
                at += n
            data.append(
                {
                    "message_log": log,
                    "length": len(piece.prompt_ids) + len(piece.response_ids),
                    "extra_env_info": {
                        "rollout_id": traj.rollout_id,
                        "group_id": traj.group_id,
                        "repetition": repetition,
                        "segment_index": piece.index,
                        "n_segments": len(parts),
                        "is_last_segment": piece.last,
                        "break_reason": piece.break_reason,
                        "finish_reason": piece.finish_reason,
                        "reward": reward,
                        "reward_components": traj.reward_components,
                    },
                    "loss_multiplier": 1.0,
                    "idx": idx,
                    "total_reward": reward if piece.last else 0.0,
                    "truncated": piece.finish_reason == "length",
                }
            )
    return data
