"""How late the event loop runs a timer: the longest stall of every other call, on `/metrics`.

Every call's work runs on one event loop, so anything that holds it (a large body decoded in
place, a long C call holding the interpreter lock) delays every other sandbox's call by as long.
A timer set `INTERVAL` seconds ahead fires late by the longest such hold in between; the probe
keeps the worst lateness since start and counts the stalls over each of `OVER` seconds
(``capture_proxy_event_loop_lag_max_seconds``, ``capture_proxy_event_loop_stalls_over_200ms_total``
and the like), so a scraper or `bench/bench_hostile_soak.py` reads a phase's stalls as the
difference of two scrapes.

A quiet proxy is probed once every `IDLE_INTERVAL` instead. Each wake-up of an otherwise idle
process costs it about 0.1 ms of CPU on a loaded machine: at 20 a second that was 2-3 ms of
CPU a second doing nothing, and 6-12% of the CPU of a proxy serving one call at a time
(docs/reports/performance.md). A `WINDOW` in which the process spent less CPU than one
`INTERVAL` (all threads, ``time.process_time``) held no CPU-bound stall that the probe counts,
so the next window is probed slowly; a window with more, or a slow probe that fired late by
`INTERVAL` or more, brings back the fast one. The probe starts fast. The cost of the saving: the
first stall after a quiet second may be measured short or missed (its timer was not due during
it); the stalls after it are not, and a busy proxy is probed as before.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["IDLE_INTERVAL", "INTERVAL", "OVER", "WINDOW", "LoopLag"]

#: Seconds between the probe's timers while the proxy is busy.
INTERVAL = 0.05
#: Seconds between them while it is quiet.
IDLE_INTERVAL = 1.0
#: Seconds over which the process's CPU decides between the two.
WINDOW = 1.0
#: Stalls counted past each of these seconds.
OVER = (0.05, 0.1, 0.2, 0.5, 1.0)


class LoopLag:
    """The lateness of the loop's timers: `run` it as a task, read `gauges`.

    `ticks` counts the timers fired and `busy` says whether the fast probe is on."""

    def __init__(
        self,
        *,
        interval: float = INTERVAL,
        idle_interval: float = IDLE_INTERVAL,
        window: float = WINDOW,
    ) -> None:
        self.interval = interval
        self.idle_interval = idle_interval
        self.window = window
        self.max_s = 0.0
        self.stalls = dict.fromkeys(OVER, 0)
        self.ticks = 0
        self.busy = True
        self._window_start = 0.0
        self._window_cpu = 0.0

    def observe(self, late_s: float) -> None:
        self.max_s = max(self.max_s, late_s)
        for over in OVER:
            if late_s > over:
                self.stalls[over] += 1

    async def run(self) -> None:
        """Probe until cancelled: a plain timer (no task woken each time), re-armed as it
        fires."""
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def tick(due: float) -> None:
            nonlocal handle
            now = time.monotonic()
            late = max(0.0, now - due)
            self.ticks += 1
            self.observe(late)
            if now - self._window_start >= self.window:
                used = time.process_time()
                self.busy = used - self._window_cpu >= self.interval or late >= self.interval
                self._window_start, self._window_cpu = now, used
            wait = self.interval if self.busy else self.idle_interval
            handle = loop.call_later(wait, tick, now + wait)

        self._window_start, self._window_cpu = time.monotonic(), time.process_time()
        self.busy = True
        handle = loop.call_later(self.interval, tick, time.monotonic() + self.interval)
        try:
            await loop.create_future()  # until cancelled
        finally:
            handle.cancel()

    def gauges(self) -> dict[str, float]:
        out = {"event_loop_lag_max_seconds": round(self.max_s, 4)}
        for over, n in self.stalls.items():
            out[f"event_loop_stalls_over_{round(over * 1000)}ms_total"] = n
        return out
