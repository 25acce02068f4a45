"""Trainer adapters: a store's rollouts in each trainer's own shape, as plain Python data.

    from capture_proxy import open_store
    from capture_proxy.read.trainers import episodes, to_skyrl, to_verl

    with open_store("sqlite:///capture.db") as store:
        batch = list(episodes(store))          # sealed, not poisoned, verified
        samples = to_verl(batch)               # AgentLoopOutput(**s["output"]) per segment
        skyrl = to_skyrl(batch)                # validate_generator_output(skyrl.num_prompts, ...)

Nothing here imports a trainer: the outputs are lists, dicts, ints, floats, strings and bytes,
which the trainer's side turns into its tensors and images (docs/trainers.md says how, per
trainer, and against which version each shape was checked). Every adapter gives a rollout's
reward once (on its last segment or call), as one number (`scalar_reward`: an object reward is
the sum of its components unless a component is named), and carries its group.
"""

from __future__ import annotations

from ._common import Episode, MissingReward, episodes, read_episode, scalar_reward
from .nemo_rl import to_nemo_rl
from .per_call import to_per_call
from .skyrl import SkyRLBatch, stop_reason, to_skyrl
from .verl import to_verl

__all__ = [
    "Episode",
    "MissingReward",
    "SkyRLBatch",
    "episodes",
    "read_episode",
    "scalar_reward",
    "stop_reason",
    "to_nemo_rl",
    "to_per_call",
    "to_skyrl",
    "to_verl",
]
