"""The bytes of request bodies one rollout may send per second (``--max-rollout-body-rate``).

Receiving a body costs the event loop about 1.6 ms per MiB (measured with py-spy under
``bench/bench_hostile_soak.py``: the socket reads and aiohttp's stream buffer), whatever the body
turns out to hold: three sandboxes sending 62 MiB bodies back to back kept the loop busy with
them, and every other sandbox's calls waited. An agent sends one call at a time, seconds apart,
so even an image session resending every image sends a few MiB a second; a token bucket per
rollout, checked from ``Content-Length`` before a byte of the body is read, leaves it alone and
refuses the flood with 429 and ``Retry-After``. A refused body over 8 MiB is not received at all:
reading stops, and the connection closes a second after the answer (``server.chat._unread_rest``;
aiohttp would otherwise read the body to discard it). A body without a length is charged once
read.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

__all__ = ["BodyRate"]

#: Rollouts whose buckets are remembered; the least recently used are forgotten past it (a
#: forgotten rollout starts with a full bucket: at most one burst more).
_REMEMBERED = 100_000


class BodyRate:
    """A token bucket of body bytes per rollout: `rate` bytes a second, up to `burst` saved.

    `rate` 0 turns it off. `take` is called before a body is read, `charge` after one whose
    length was not known."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _level(self, rollout_id: str, now: float) -> float:
        level, at = self._buckets.pop(rollout_id, (self.burst, now))
        return min(self.burst, level + (now - at) * self.rate)

    def _keep(self, rollout_id: str, level: float, now: float) -> None:
        buckets = self._buckets
        buckets[rollout_id] = (level, now)
        if len(buckets) > _REMEMBERED:
            buckets.popitem(last=False)
        # A bucket that has filled again is what a forgotten one starts as: forget it. The
        # least recently used come first (each at most `burst` / `rate` seconds after its last
        # body), so a proxy remembers the rollouts that sent bodies lately, not every rollout
        # it served (100,000 at 0.3 KB each would take hours to fill, growing all along).
        while buckets:
            oldest, (old_level, at) = next(iter(buckets.items()))
            if old_level + (now - at) * self.rate < self.burst:
                break
            del buckets[oldest]

    def take(self, rollout_id: str, size: int) -> int | None:
        """Take `size` bytes from the rollout's bucket: None if they were there, else the whole
        seconds to wait before they are (nothing is taken then)."""
        if self.rate <= 0:
            return None
        now = time.monotonic()
        level = self._level(rollout_id, now)
        wanted = min(size, self.burst)  # a body over the burst waits for a full bucket
        if level >= wanted:
            self._keep(rollout_id, level - wanted, now)
            return None
        self._keep(rollout_id, level, now)
        return max(1, math.ceil((wanted - level) / self.rate))

    def charge(self, rollout_id: str, size: int) -> None:
        """Take `size` bytes already received (a body without ``Content-Length``): the bucket
        may go below empty, and the rollout's next body waits for it to fill again."""
        if self.rate > 0:
            now = time.monotonic()
            self._keep(rollout_id, self._level(rollout_id, now) - size, now)
