"""Batches for trainers, live: the next N rollouts (or N complete groups) that are sealed, graded,
clean and verified, each delivered once per consumer, across restarts of either side.

    >>> store = open_store("sqlite:///capture.db")     # or open_store("http://proxy:8100", token=T)
    >>> for batch in store.batches(consumer="trainer-a", groups=4, group_size=8, max_staleness=1):
    ...     train(batch.trajectories)                  # 4 complete groups of 8, verified
    ...     batch.ack()                                # never delivered to trainer-a again

Each call blocks until a batch is ready (or `wait_s` passes). A batch is recorded in the store,
under the consumer's name, before it is handed over; it is handed over again, the same batch,
until `RolloutBatch.ack` is called: a trainer that crashes mid-step gets it back when it starts
again, and one that acknowledged never sees those rollouts again. Rollouts skipped for good
(poisoned, stale, not verified, ...) are said in the next batch's `skipped`, each once.

A store reached through a proxy (``http://``) keeps the consumer's place on the proxy's store:
the proxy picks the batch (``POST /admin/store/batches/{consumer}/next``, a long poll) and the
trainer reads and verifies each rollout itself; docs/batches.md describes the routes.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .batch_queue import BatchPlan, BatchQueue, BatchRequest, BatchUnknown, Skipped

if TYPE_CHECKING:
    from .reader import Store
    from .trajectory import Trajectory

__all__ = [
    "BatchPlan",
    "BatchRequest",
    "BatchUnknown",
    "RemoteBatches",
    "RolloutBatch",
    "Skipped",
    "iter_batches",
    "next_batch",
]

#: How often a local store is looked at again while a consumer waits.
POLL_S = 0.25


@runtime_checkable
class RemoteBatches(Protocol):
    """A source that asks its proxy for batches (`capture_proxy.sinks.remote.RemoteSource`)."""

    def next_batch(
        self, consumer: str, request: dict[str, Any], wait_s: float
    ) -> dict[str, Any] | None:
        """The proxy's next batch for `consumer` (a `BatchPlan` dict), or None after `wait_s`."""
        ...

    def ack_batch(self, consumer: str, batch_id: str) -> int:
        """Acknowledge the batch on the proxy; how many rollouts were acknowledged."""
        ...


@dataclass(eq=False)
class RolloutBatch:
    """A batch handed to a trainer: its verified trajectories, in order (group after group),
    and what was skipped since the previous batch. Call `ack` once it is used."""

    plan: BatchPlan
    trajectories: list[Trajectory]
    _store: Store = field(repr=False)

    @property
    def batch_id(self) -> str:
        return self.plan.batch_id

    @property
    def rollout_ids(self) -> tuple[str, ...]:
        return self.plan.rollout_ids

    @property
    def groups(self) -> dict[str, list[Trajectory]]:
        """Group id -> its trajectories (a batch of groups; empty for a batch of rollouts)."""
        by_id = {t.rollout_id: t for t in self.trajectories}
        return {g: [by_id[r] for r in ids] for g, ids in self.plan.groups.items()}

    @property
    def skipped(self) -> tuple[Skipped, ...]:
        """Rollouts this consumer will never get, each with its reason (`Skipped`)."""
        return self.plan.skipped

    @property
    def redelivered(self) -> bool:
        """Handed over before and not acknowledged (the trainer restarted, or did not ack)."""
        return self.plan.redelivered

    def ack(self) -> int:
        """Record the batch as used (in the store): its rollouts are never delivered to this
        consumer again. Acknowledging twice is harmless (the second returns 0)."""
        source = self._store.source
        if isinstance(source, RemoteBatches):
            return source.ack_batch(self.plan.consumer, self.plan.batch_id)
        return _queue(self._store).ack(self.plan.consumer, self.plan.batch_id)


_QUEUES: weakref.WeakKeyDictionary[Store, BatchQueue] = weakref.WeakKeyDictionary()


def _queue(store: Store) -> BatchQueue:
    queue = _QUEUES.get(store)
    if queue is None:
        queue = _QUEUES[store] = BatchQueue(store)
    return queue


def next_batch(
    store: Store,
    consumer: str,
    request: BatchRequest,
    *,
    wait_s: float | None = 30.0,
    poll_s: float = POLL_S,
) -> RolloutBatch | None:
    """The consumer's next batch, waiting up to `wait_s` seconds for it (None: forever);
    None when none was ready in time."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    source = store.source
    while True:
        left = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
        if isinstance(source, RemoteBatches):
            # The proxy waits (a long poll of at most `left`); the trainer verifies what it reads.
            doc = source.next_batch(consumer, request.to_dict(), min(left, 30.0))
            if doc is not None:
                plan = BatchPlan.from_dict(doc)
                trajectories = [store.trajectory(r, verify=True) for r in plan.rollout_ids]
                return RolloutBatch(plan, trajectories, store)
        else:
            got = _queue(store).next(consumer, request)
            if got is not None:
                return RolloutBatch(got[0], got[1], store)
            if deadline is None or time.monotonic() < deadline:
                time.sleep(poll_s if deadline is None else min(poll_s, left))
        if deadline is not None and time.monotonic() >= deadline:
            return None


def iter_batches(
    store: Store,
    consumer: str,
    request: BatchRequest,
    *,
    wait_s: float | None = None,
    poll_s: float = POLL_S,
) -> Iterator[RolloutBatch]:
    """Batch after batch (see `next_batch`); ends when none came within `wait_s` (by default it
    waits forever). A batch not acknowledged when the next is asked for comes again."""
    while True:
        batch = next_batch(store, consumer, request, wait_s=wait_s, poll_s=poll_s)
        if batch is None:
            return
        yield batch
