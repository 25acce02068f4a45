"""Calls in flight shared fairly between rollouts once the proxy is busy (``--fair-share-*``).

The proxy's event loop is one core's worth of work for every sandbox together: each call it
admits costs loop time to relay, and a sandbox that keeps many calls in flight (a stream flood,
or a runaway agent) takes that time from the others. ``--max-inflight-per-rollout`` caps a rollout
outright; this shares what is left once it matters. While fewer than ``--fair-share-inflight``
chat calls are in flight, every call goes at once. From there on:

- a call of a rollout with nothing in flight goes at once (an agent makes one call at a time:
  it never waits behind anyone);
- a call of a rollout holding less than its share (the threshold over the rollouts with calls in
  flight, at least `MIN_SHARE`: an agent's call and its title call) goes at once;
- any other call waits its turn, in its rollout's queue (first come, first served within the
  rollout, at most ``--fair-share-queue`` waiting). Each time a call ends, the waiting rollout
  with the fewest calls in flight goes next, if the proxy is under the threshold again or that
  rollout under its share. A waiting rollout always has a call in flight whose end wakes it, so
  no rollout waits for ever; past ``--fair-share-wait`` seconds, or with its queue full, the call
  gets 429 ``rollout_over_fair_share`` with ``Retry-After``.

A call waits before its body is read: waiting holds its connection, never its body. Counted from
the turn given until the call's handler returns (the answer relayed). Measured with
``bench/bench_hostile_soak.py`` (docs/reports/reliability.md).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

from ..errors import TooManyRequests

__all__ = ["MIN_SHARE", "FairShare"]

#: A rollout's share never falls below this: an agent's call and OpenCode's title call beside it.
MIN_SHARE = 2


class FairShare:
    """The turns of chat calls: `turn` before a call's body is read, `release` once it ended.

    `threshold` 0 turns the sharing off (calls are still counted)."""

    def __init__(self, threshold: int, queue: int, wait_s: float) -> None:
        self.threshold = threshold
        self.queue = queue
        self.wait_s = wait_s
        #: Calls holding a turn, by rollout (a rollout with none is not a key).
        self._held: dict[str, int] = {}
        self._total = 0
        #: Waiting calls by rollout, oldest first, each with its place in the arrival order.
        self._waiting: dict[str, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._arrivals = itertools.count()
        #: Calls that waited, and calls refused (both since start; `/metrics`).
        self.waited = 0
        self.refused = 0

    @property
    def in_flight(self) -> int:
        """Calls holding a turn."""
        return self._total

    @property
    def waiting(self) -> int:
        """Calls waiting for a turn."""
        return sum(len(q) for q in self._waiting.values())

    def share(self) -> int:
        """What one rollout may hold while the proxy is at its threshold."""
        return max(MIN_SHARE, self.threshold // max(1, len(self._held)))

    def _may_go(self, rollout_id: str) -> bool:
        held = self._held.get(rollout_id, 0)
        return held == 0 or self._total < self.threshold or held < self.share()

    def _take(self, rollout_id: str) -> None:
        self._held[rollout_id] = self._held.get(rollout_id, 0) + 1
        self._total += 1

    async def turn(self, rollout_id: str) -> None:
        """Return once the call may go (at once unless the proxy is busy and the rollout holds its
        share); raise 429 ``rollout_over_fair_share`` if its rollout's queue is full or the wait
        outlasts ``--fair-share-wait``. Each return must be matched by one `release`."""
        if not self.threshold or (rollout_id not in self._waiting and self._may_go(rollout_id)):
            self._take(rollout_id)
            return
        queue = self._waiting.setdefault(rollout_id, deque())
        if len(queue) >= self.queue:
            self.refused += 1
            raise self._refusal(rollout_id, f"{len(queue)} of its calls are waiting already")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (next(self._arrivals), waiter)
        queue.append(entry)
        self.waited += 1
        try:
            async with asyncio.timeout(self.wait_s):
                await waiter
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():
                self.release(rollout_id)  # given its turn as it gave up: pass the turn on
            else:
                self._forget(rollout_id, entry)
            if isinstance(e, TimeoutError):
                self.refused += 1
                raise self._refusal(
                    rollout_id, f"its call waited {self.wait_s:g}s for a turn"
                ) from None
            raise

    def release(self, rollout_id: str) -> None:
        """The call given a turn by `turn` ended: the next waiting call may go."""
        held = self._held.get(rollout_id, 0) - 1
        if held > 0:
            self._held[rollout_id] = held
        else:
            self._held.pop(rollout_id, None)
        self._total -= 1
        self._wake()

    def _wake(self) -> None:
        # The fewest in flight first (then the longest waiting): if that rollout may not go,
        # none may, since a rollout's chance only falls with what it holds.
        while self._waiting:
            rollout_id = min(
                self._waiting,
                key=lambda r: (self._held.get(r, 0), self._waiting[r][0][0]),
            )
            if not self._may_go(rollout_id):
                return
            queue = self._waiting[rollout_id]
            _, waiter = queue.popleft()
            if not queue:
                del self._waiting[rollout_id]
            if waiter.done():
                continue  # cancelled (its client left, or its wait ran out) and not yet forgotten
            self._take(rollout_id)  # counted now, so that turns given together cannot overshoot
            waiter.set_result(None)

    def _forget(self, rollout_id: str, entry: tuple[int, asyncio.Future[None]]) -> None:
        queue = self._waiting.get(rollout_id)
        if queue is None:
            return
        if entry in queue:
            queue.remove(entry)
        if not queue:
            del self._waiting[rollout_id]
        self._wake()  # a rollout behind it in the order may go now

    def _refusal(self, rollout_id: str, why: str) -> TooManyRequests:
        return TooManyRequests(
            f"rollout {rollout_id} holds {self._held.get(rollout_id, 0)} of the proxy's "
            f"{self._total} calls in flight, its fair share or more (--fair-share-inflight "
            f"{self.threshold}), and {why}: retry once its calls are answered",
            code="rollout_over_fair_share",
            headers={"Retry-After": "1"},
        )
