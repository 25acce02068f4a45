"""The benchmark's load generator, in its own process (so its CPU is not the proxy's).

    .venv/bin/python bench/loadgen.py --url http://127.0.0.1:PORT --mode poisson --rate 100 \
        --duration 8 [--stream] [--seed 1] [--tag run1]

Sends the workload's request (`workload.build_workload`) over loopback with aiohttp, either with
Poisson arrivals at `rate` calls/s (open loop: the schedule comes from `seed`, so two targets see
the same arrivals) or from `concurrency` workers each sending its next call when the last one
ended (closed loop). Bounded in time: no call starts after `duration` seconds, and each has a
`timeout`. Prints one JSON object: per-call latencies and times to first body byte (ok calls
only), counts, a few error messages, and the elapsed time.

A call is ok when it answers 200 with the whole body, and, for capture-proxy, says it was
staged: ``X-Capture-Status: staged``, or for a stream the ``: capture-status staged`` comment
before ``data: [DONE]``. Calls are turns of `rollouts` interleaved agent sessions
(``X-Rollout-Id: <tag>-<session>-<cycle>``): call i is turn (i // rollouts) % TURNS of session
i % rollouts, tagged into the request so that the upstream answers that turn
(`workload.tag_request`), so lineage and storage see sessions that grow turn by turn.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import aiohttp
import orjson
from load_result import write_result
from workload import TURNS, build_workload, tag_request

from capture_proxy.server.event_loop import LOOPS, run


def _error_code(body: bytes) -> str:
    """The ``error.code`` of a proxy's JSON error body ("" when it has none)."""
    try:
        error = orjson.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(error.get("code") or "") if isinstance(error, dict) else ""


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        w = build_workload(args.workload_seed)
        self.template = w.stream_request if args.stream else w.request
        self.url = args.url.rstrip("/") + "/v1/chat/completions"
        self.latencies: list[float] = []
        self.ttfbs: list[float] = []
        self.errors: list[str] = []
        self.sent = 0
        self.bytes = 0
        self.session: aiohttp.ClientSession

    def rollout_and_body(self, i: int) -> tuple[str, bytes]:
        """Call i is turn (i // rollouts) % TURNS of session i % rollouts of its cycle."""
        r = self.args.rollouts
        turn = (i // r) % TURNS
        rollout = f"{self.args.tag}-{i % r}-{i // (r * TURNS)}"
        return rollout, tag_request(self.template, turn, i)

    async def call(self, i: int) -> None:
        a = self.args
        self.sent += 1
        rollout, body = self.rollout_and_body(i)
        headers = {"Content-Type": "application/json", "X-Rollout-Id": rollout}
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(a.timeout):
                async with self.session.post(self.url, data=body, headers=headers) as resp:
                    if a.stream:
                        ttfb, tail, size = await self._read_stream(resp, t0)
                    else:
                        data = await resp.read()
                        tail = data if resp.status != 200 else data[-64:]  # an error body whole
                        ttfb, size = time.perf_counter() - t0, len(data)
                    elapsed = time.perf_counter() - t0
                    problem = self._check(resp, tail)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
            return
        self.bytes += size
        if problem:
            self.errors.append(problem)
            return
        self.latencies.append(elapsed)
        self.ttfbs.append(ttfb)

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, t0: float
    ) -> tuple[float, bytes, int]:
        ttfb = 0.0
        size = 0
        tail = b""
        while chunk := await resp.content.readany():
            if not size:
                ttfb = time.perf_counter() - t0
            size += len(chunk)
            tail = (tail + chunk)[-256:]
        return ttfb, tail, size

    def _check(self, resp: aiohttp.ClientResponse, tail: bytes) -> str | None:
        if resp.status != 200:
            # The error body's code says which refusal it was (staging_backlog, paused, ...).
            return f"HTTP {resp.status} {_error_code(tail)}".rstrip()
        status = resp.headers.get("X-Capture-Status")
        if self.args.stream:
            if not tail.endswith(b"data: [DONE]\n\n"):
                return f"stream did not end with [DONE]: {tail[-120:]!r}"
            if status is not None and b": capture-status staged" not in tail:
                return f"stream not staged: {tail[-160:]!r}"
        elif status is not None and status != "staged":
            return f"X-Capture-Status: {status}"
        return None

    async def poisson(self) -> None:
        a = self.args
        rng = random.Random(a.seed)
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks: list[asyncio.Task[None]] = []
        t = 0.0
        i = 0
        while True:
            t += rng.expovariate(a.rate)
            if t > a.duration or (a.count and i >= a.count):
                break
            delay = start + t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.call(i)))
            i += 1
        await self._drain(tasks)

    async def _drain(self, tasks: list[asyncio.Task[None]]) -> None:
        """Wait for calls in flight, at most `drain` seconds: a target that cannot keep up
        ends the run with its late calls counted as errors, not with an unbounded wait."""
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=self.args.drain)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)
            self.errors += [f"not finished {self.args.drain:g}s after the last arrival"] * len(late)

    async def closed(self) -> None:
        a = self.args
        loop = asyncio.get_running_loop()
        end = loop.time() + a.duration
        counter = iter(range(10**9))

        async def worker() -> None:
            while loop.time() < end:
                i = next(counter)
                if a.count and i >= a.count:
                    return
                await self.call(i)

        workers = [asyncio.create_task(worker()) for _ in range(a.concurrency)]
        _, running = await asyncio.wait(workers, timeout=a.duration)
        await self._drain(list(running))

    async def run(self) -> dict[str, Any]:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as self.session:
            t0 = time.perf_counter()
            await (self.poisson() if self.args.mode == "poisson" else self.closed())
            elapsed = time.perf_counter() - t0
        return {
            "sent": self.sent,
            "ok": len(self.latencies),
            "errors": len(self.errors),
            "error_samples": sorted(set(self.errors))[:5],
            "elapsed": elapsed,
            "bytes": self.bytes,
            "latencies": self.latencies,
            "ttfbs": self.ttfbs,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--mode", choices=("poisson", "closed"), default="poisson")
    p.add_argument("--rate", type=float, default=100.0, help="Poisson arrivals, calls/s")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop workers")
    p.add_argument("--duration", type=float, default=8.0, help="seconds during which calls start")
    p.add_argument("--count", type=int, default=0, help="at most this many calls (0: no limit)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--seed", type=int, default=1, help="the arrival schedule's seed")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--tag", default="bench", help="rollout id prefix")
    p.add_argument("--rollouts", type=int, default=32, help="interleaved sessions")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    p.add_argument(
        "--drain", type=float, default=20.0, help="seconds to wait for calls after the last start"
    )
    p.add_argument("--loop", choices=LOOPS, default=LOOPS[0], help="event loop")
    p.add_argument("--out", default=None, help="write the result (JSON) here, not to stdout")
    args = p.parse_args()
    result = run(Load(args).run(), args.loop)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
