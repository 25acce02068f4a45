"""The trainer's read step: a batch from the store's batch API, as plain data the trainer takes.

`take_batch` asks the store for the consumer's next batch (``Store.next_batch``: sealed, graded,
not poisoned and verified rollouts, each delivered once, docs/batches.md) and turns it into the
`Batch` the trainer process reads; the caller acknowledges it once the training step is done, so
a loop that dies mid-step gets the same batch again. It is the one function to swap when batches
come another way: the trainer only needs the `Batch`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capture_proxy import open_store

if TYPE_CHECKING:
    from capture_proxy.read.reader import Store
    from capture_proxy.read.trajectory import Trajectory

__all__ = ["GUIDED_KEYS", "Batch", "Sample", "sample_of", "take_batch"]

#: Request keys that make vLLM decode under a grammar (structured outputs).
GUIDED_KEYS = (
    "structured_outputs",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
)


@dataclass
class Sample:
    """One rollout's trajectory, in the shape the trainer reads (lists, JSON-ready)."""

    rollout_id: str
    group_id: str
    reward: float
    token_ids: list[int]
    #: 1 on the tokens the policy sampled (trained on), 0 on prompt, tool and bridge tokens.
    loss_mask: list[int]
    #: The logprob vLLM recorded for each sampled token (0.0 elsewhere).
    logprobs: list[float]
    #: Per token, the index in `samplings` of the call that added it.
    call_index: list[int]
    #: The trajectory's segments, ``[start, end)`` over `token_ids`: each is one sequence the
    #: model saw (a new segment starts where a call did not extend the previous one).
    segments: list[tuple[int, int]]
    #: Per call (in trajectory order): the sampling vLLM applied (the record's
    #: `effective_sampling`, plus the request's `logit_bias` if any), its logprobs mode, and
    #: ``guided``: whether it decoded under a grammar (`GUIDED_KEYS`).
    samplings: list[dict[str, Any]]
    #: Per token: the driver's weight version, and the engine's own (None where unknown).
    weight_versions: list[int]
    engine_weight_versions: list[str | None]


@dataclass
class Batch:
    samples: list[Sample] = field(default_factory=list)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"samples": [asdict(s) for s in self.samples]}))


def take_batch(
    store_url: str, consumer: str, rollouts: int, *, wait_s: float = 120.0
) -> tuple[Batch, Callable[[], None]]:
    """The consumer's next batch of `rollouts` rollouts, and the function that acknowledges it.

    Blocks until that many are sealed, graded, clean and verified (up to `wait_s`: then
    `TimeoutError`). Raises `ValueError` for a rollout with no numeric reward or a call whose
    sampling is unknown (the trainer could not recompute its logprobs), naming the rollout.
    """
    store = open_store(store_url)
    try:
        taken = store.next_batch(consumer, rollouts=rollouts, wait_s=wait_s)
        if taken is None:
            raise TimeoutError(f"no batch of {rollouts} rollouts for {consumer} in {wait_s:g}s")
        batch = Batch([sample_of(store, traj) for traj in taken.trajectories])
    except BaseException:
        store.close()
        raise

    def ack() -> None:
        try:
            taken.ack()
        finally:
            store.close()

    return batch, ack


def sample_of(store: Store, traj: Trajectory) -> Sample:
    """One delivered trajectory in the trainer's shape, with each call's sampling."""
    if traj.reward is None or traj.group_id is None:
        raise ValueError(f"rollout {traj.rollout_id} has no numeric reward and group")
    records = {r.call_id: r for r in store.calls(traj.rollout_id)}
    samplings = []
    for call_id in traj.calls:
        record = records[call_id]
        if record.effective_sampling is None:
            raise ValueError(f"rollout {traj.rollout_id}: call {call_id}'s sampling is unknown")
        sampling = dict(record.effective_sampling)
        if record.request.get("logit_bias"):
            sampling["logit_bias"] = record.request["logit_bias"]
        sampling["logprobs_mode"] = record.logprobs_mode
        # Guided decoding masks the distribution with a grammar the trainer does not have: its
        # tokens' logprobs cannot be recomputed from the model alone.
        sampling["guided"] = any(k in record.request for k in GUIDED_KEYS)
        samplings.append(sampling)
    return Sample(
        rollout_id=traj.rollout_id,
        group_id=traj.group_id,
        reward=traj.reward,
        token_ids=traj.token_ids.tolist(),
        loss_mask=traj.loss_mask.tolist(),
        logprobs=traj.logprobs.tolist(),
        call_index=traj.call_index.tolist(),
        segments=[(s.start, s.end) for s in traj.segments],
        samplings=samplings,
        weight_versions=traj.weight_versions.tolist(),
        engine_weight_versions=list(traj.engine_weight_versions),
    )
