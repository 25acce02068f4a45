"""How late the event loop runs a timer: the longest stall of every other call, on `/metrics`.

Every call's work runs on one event loop, so anything that holds it (a large body decoded in
place, a long C call holding the interpreter lock) delays every other sandbox's call by as long.
A timer set `INTERVAL` seconds ahead fires late by the longest such hold in between; the probe
keeps the worst lateness since start and counts the stalls over each of `OVER` seconds
(``capture_proxy_event_loop_lag_max_seconds``, ``capture_proxy_event_loop_stalls_over_200ms_total``
and the like), so a scraper or `bench/bench_hostile_soak.py` reads a phase's stalls as the
difference of two scrapes. Costs one wake-up every 50 ms.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["INTERVAL", "OVER", "LoopLag"]

#: Seconds between the probe's timers.
INTERVAL = 0.05
#: Stalls counted past each of these seconds.
OVER = (0.05, 0.1, 0.2, 0.5, 1.0)


class LoopLag:
    """The lateness of the loop's timers: `run` it as a task, read `gauges`."""

    def __init__(self) -> None:
        self.max_s = 0.0
        self.stalls = dict.fromkeys(OVER, 0)

    def observe(self, late_s: float) -> None:
        self.max_s = max(self.max_s, late_s)
        for over in OVER:
            if late_s > over:
                self.stalls[over] += 1

    async def run(self) -> None:
        while True:
            expected = time.monotonic() + INTERVAL
            await asyncio.sleep(INTERVAL)
            self.observe(max(0.0, time.monotonic() - expected))

    def gauges(self) -> dict[str, float]:
        out = {"event_loop_lag_max_seconds": round(self.max_s, 4)}
        for over, n in self.stalls.items():
            out[f"event_loop_stalls_over_{round(over * 1000)}ms_total"] = n
        return out
