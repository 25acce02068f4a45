"""The event loop's stalls on `/metrics` (issue 27: no request may stall the loop over 200 ms).

The proxy runs as ``capture-proxy serve`` runs it; the test holds its loop for 300 ms on purpose
(the loop is shared with the test) and reads the stall back from the proxy's own scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from capture_proxy.server.loop_lag import LoopLag
from tests.server.test_slow_clients import answer_of, served


async def _scrape(port: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: proxy\r\n\r\n")
        text = (await answer_of(reader))[2].decode()
    finally:
        writer.close()
    return {
        name: float(value)
        for name, _, value in (line.partition(" ") for line in text.splitlines())
        if name.startswith("capture_proxy_event_loop_")
    }


async def test_a_stall_of_the_event_loop_is_counted_and_its_length_kept(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        before = await _scrape(s.port)
        await asyncio.sleep(0.2)  # the probe's timer is set
        time.sleep(0.3)  # noqa: ASYNC251 (the stall under test: the loop held on purpose)
        await asyncio.sleep(0.1)  # the probe's late timer fires
        after = await _scrape(s.port)
        over_200ms = "capture_proxy_event_loop_stalls_over_200ms_total"
        assert after[over_200ms] >= before[over_200ms] + 1
        assert after["capture_proxy_event_loop_lag_max_seconds"] >= 0.25


async def test_a_quiet_loop_is_probed_slowly_and_fast_again_once_it_works() -> None:
    lag = LoopLag(interval=0.02, idle_interval=0.2, window=0.1)
    probe = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.35)  # the first window (fast) spent next to no CPU: slow since
        assert not lag.busy
        ticks = lag.ticks
        await asyncio.sleep(0.45)
        assert lag.ticks - ticks <= 8  # every 0.2 s (3), not every 0.02 s (22); a late one: 8

        # CPU-bound work longer than the fast interval: the probe's next timer turns it fast.
        started = time.process_time()
        while time.process_time() - started < 0.05:
            pass
        ticks = lag.ticks
        for _ in range(100):  # the slow timer's next firing, within 0.2 s
            await asyncio.sleep(0.005)
            if lag.ticks > ticks:
                break
        assert lag.busy
        before = lag.stalls[0.05]
        time.sleep(0.1)  # noqa: ASYNC251 (a stall while busy: its timer is due within 0.02 s)
        await asyncio.sleep(0.05)
        assert lag.stalls[0.05] >= before + 1
        assert lag.max_s >= 0.07
    finally:
        probe.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probe
