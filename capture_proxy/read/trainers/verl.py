"""verl: one `AgentLoopOutput` per segment, in verl's multi-output form.

Held to verl's own code: `verl.experimental.agent_loop.agent_loop.AgentLoopOutput` and
`AgentLoopMetrics` (b178a3c; checked against the published verl 0.9.1 by
tests/read/trainers/), and verl 0.9.1's rule for an agent loop that returns several outputs
(`trainer/ppo/v1`): outputs are keyed ``{uid}_{session_id}_{index}``; the reward is given on the
final output of a session and copied to the others by verl; GRPO groups the sessions' final
outputs by ``uid`` and gives each output of a session its final output's advantage.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._common import Episode, pieces, repetitions, scalar_reward

__all__ = ["to_verl"]

#: verl's `AgentLoopMetrics` are timings the agent loop measured; the proxy does not time the
#: agent's work, so they are verl's own defaults.
_METRICS = {"generate_sequences": 0.0, "tool_calls": 0.0, "num_preempted": -1}


def to_verl(
    episodes: Iterable[Episode], *, reward_component: str | None = None
) -> list[dict[str, Any]]:
    """One verl sample per segment of each episode, in order.

    Each sample is ``{"key", "uid", "session_id", "index", "output"}``: `output` holds the keyword
    arguments of verl's ``AgentLoopOutput(**output)``; `uid` is the rollout's group (its id when
    it has none: GRPO's ``non_tensor_batch["uid"]``), `session_id` its repetition within the
    group (0, 1, ...), `index` the segment, and `key` is verl's ``f"{uid}_{session_id}_{index}"``.

    - ``reward_score`` is the rollout's reward (`scalar_reward`: an object reward is the sum of
      its components, or `reward_component`) on its **last** segment only, and None on the others:
      verl copies it to a session's earlier outputs. The components are the last output's
      ``extra_fields["reward_extra_info"]`` (verl's per-sample reward details).
    - ``multi_modal_data`` is ``{"images": [{"bytes": ...}, ...]}`` for a segment whose calls sent
      images (one per image part of the segment's prompt, in order, an image sent twice listed
      twice, as verl's processor pairs them with the placeholder runs of ``prompt_ids``; the
      form verl's dataset reads from Parquet): turn each into an
      image with verl's ``process_image`` (or ``PIL.Image.open(io.BytesIO(item["bytes"]))``)
      before verl's processor sees them. None for a segment without images.
    - ``num_turns`` is verl's count for the rollout: user and assistant turns + 1, that is twice
      its calls (each call is an assistant turn; each call after the first follows one turn of
      tool results or user input).
    - ``metrics`` are verl's defaults (the proxy does not time the agent); ``extra_fields``
      carries ``capture_proxy``: the rollout id, group, segment, break reason and finish reason.

    Raises `MissingReward` for a rollout without a reward.
    """
    eps = list(episodes)
    samples: list[dict[str, Any]] = []
    for ep, (uid, session) in zip(eps, repetitions([e.trajectory for e in eps]), strict=True):
        traj = ep.trajectory
        reward = scalar_reward(traj, reward_component)
        parts = pieces(ep)
        for piece in parts:
            extra: dict[str, Any] = {
                "capture_proxy": {
                    "rollout_id": traj.rollout_id,
                    "group_id": traj.group_id,
                    "segment_index": piece.index,
                    "n_segments": len(parts),
                    "break_reason": piece.break_reason,
                    "finish_reason": piece.finish_reason,
                }
            }
            if piece.last:
                extra["reward_extra_info"] = dict(traj.reward_components or {})
            images = [{"bytes": data} for _, _, data in piece.images]
            output = {
                "prompt_ids": piece.prompt_ids,
                "response_ids": piece.response_ids,
                "response_mask": piece.response_mask,
                "response_logprobs": piece.response_logprobs,
                "routed_experts": None,
                "multi_modal_data": {"images": images} if images else None,
                "reward_score": reward if piece.last else None,
                "num_turns": 2 * len(traj.calls),
                "metrics": dict(_METRICS),
                "extra_fields": extra,
            }
            samples.append(
                {
                    "key": f"{uid}_{session}_{piece.index}",
                    "uid": uid,
                    "session_id": session,
                    "index": piece.index,
                    "output": output,
                }
            )
    return samples
