"""The idle timeout and total deadline of one upstream stream's reads, with one timer.

``asyncio.timeout()`` around each read schedules and cancels a timer per chunk: ~10 µs, a third of
what relaying a token chunk costs. Here a read only records when it started waiting
(`ReadWatch.waiting_since`, None between reads: writing to the client does not count), and one
timer wakes when the current read would be due; when it is, the watch records which limit
passed (`expired`) and calls the client's `on_expire`, which fails or wakes the waiting read.
Both upstream clients use it: aiohttp's (`http.py`) and the lean one (`rpc.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

from ..errors import UpstreamFailed

__all__ = ["Expiry", "ReadWatch", "past_deadline"]

#: Which limit a read passed: the idle timeout, or the call's total deadline.
Expiry = Literal["idle", "deadline"]


class ReadWatch:
    """Watches one stream's reads: `idle` seconds per read, `deadline` in loop time (None:
    none). Set `waiting_since` to the loop time when a read starts waiting and back to None
    when it returns; call `stop` when the stream ends."""

    def __init__(
        self, idle: float, deadline: float | None, on_expire: Callable[[Expiry], None]
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._idle = idle
        self._deadline = deadline
        self._on_expire = on_expire
        self.waiting_since: float | None = None
        self.expired: Expiry | None = None
        self._handle = self.loop.call_at(self._due(self.loop.time()), self._check)

    def _due(self, since: float) -> float:
        due = since + self._idle
        return due if self._deadline is None else min(due, self._deadline)

    def _check(self) -> None:
        since = self.waiting_since
        now = self.loop.time()
        if since is not None and self._deadline is not None and now >= self._deadline:
            self.expired = "deadline"
        elif since is not None and now - since >= self._idle:
            self.expired = "idle"
        if self.expired is not None:
            self._on_expire(self.expired)
            return
        if since is not None:
            due = self._due(since)
        elif self._deadline is not None and self._deadline > now:
            due = min(now + self._idle, self._deadline)
        else:
            due = now + self._idle  # past the deadline between reads: the read loop checks it
        self._handle = self.loop.call_at(due, self._check)

    def stop(self) -> None:
        self._handle.cancel()


def past_deadline(total: float) -> UpstreamFailed:
    """The error of an answer not whole within the call's total timeout (`total` seconds)."""
    return UpstreamFailed(
        f"the upstream's answer was not whole within {total:g}s (--upstream-total-timeout)",
        code="upstream_deadline",
        status=504,
    )
