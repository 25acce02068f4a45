"""One large hostile request against a real proxy process, while another client is served.

    .venv/bin/python bench/bench_big_body.py                      # 20 MiB of numbers, then of {}
    .venv/bin/python bench/bench_big_body.py --mib 60 --shapes empty_objects

Starts ``capture-proxy serve --upstream fake`` with a SQLite store in a temporary folder. For each
shape, one client sends a single request of about `--mib` MiB whose free-form JSON holds millions
of small values (``chat_template_kwargs`` full of small numbers or empty objects, or one tool's
``parameters`` full of them), while a second client sends small calls one after another and
records each call's latency. Reported per shape: the worst and the median latency of the small
client's calls while the big call was in flight (how long the event loop froze), the proxy's peak
RSS during the shape (VmHWM, reset before it where the kernel allows), the big call's HTTP status
and error code, and how long it took. Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from bench_proxy import Proc  # bench/ is a folder of scripts run by path: siblings import flat
from procstat import peak_rss_mb, reset_peak_rss, rss_mb

SHAPES = ("numbers", "empty_objects", "tool_parameters")
_SMALL = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def hostile_body(shape: str, mib: float) -> bytes:
    """A chat request of about `mib` MiB whose free-form JSON is millions of tiny values."""
    target = int(mib * 2**20)
    if shape == "numbers":
        item, where = b"7,", "chat_template_kwargs"
    elif shape == "empty_objects":
        item, where = b"{},", "chat_template_kwargs"
    else:
        item, where = b"{},", "tool_parameters"
    filler = b"[" + item * (target // len(item)) + b"0]"
    head = b'{"model":"policy","messages":[{"role":"user","content":"hi"}],"max_tokens":4,'
    if where == "chat_template_kwargs":
        return head + b'"chat_template_kwargs":{"x":' + filler + b"}}"
    tool = b'{"type":"function","function":{"name":"f","parameters":{"type":"object","x":'
    return head + b'"tools":[' + tool + filler + b"}}}]}"


async def _small_client(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[tuple[float, float]]
) -> None:
    """Small calls back to back until `stop` (bounded: at most 100,000 calls)."""
    for _ in range(100_000):
        if stop.is_set():
            return
        t = time.perf_counter()
        async with session.post(url, json=_SMALL) as resp:
            await resp.read()
            assert resp.status == 200, resp.status
        out.append((t, time.perf_counter() - t))


async def run_shape(base: str, pid: int, shape: str, mib: float) -> dict[str, Any]:
    body = hostile_body(shape, mib)
    reset = reset_peak_rss(pid)
    rss_before = rss_mb(pid)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        stop = asyncio.Event()
        lat: list[tuple[float, float]] = []
        small_url = f"{base}/r/small-{shape}/v1/chat/completions"
        small = asyncio.create_task(_small_client(session, small_url, stop, lat))
        await asyncio.sleep(1.0)  # the small client's baseline
        t0 = time.perf_counter()
        status, code = 0, ""
        try:
            async with session.post(
                f"{base}/r/big-{shape}/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as resp:
                status = resp.status
                answer = await resp.read()
                if status != 200:
                    code = orjson.loads(answer).get("error", {}).get("code", "")
        except aiohttp.ClientError as e:
            code = f"{type(e).__name__}"
        t1 = time.perf_counter()
        big_s = t1 - t0
        await asyncio.sleep(1.0)
        stop.set()
        await small
    during = [d for (t, d) in lat if t0 - 0.001 <= t + d and t <= t1]
    before = [d for (t, d) in lat if t + d < t0]
    return {
        "shape": shape,
        "body_mib": round(len(body) / 2**20, 1),
        "status": status,
        "code": code,
        "big_call_s": round(big_s, 2),
        "small_calls_during": len(during),
        "worst_stall_s": round(max(during, default=0.0), 3),
        "median_during_ms": round(1000 * statistics.median(during), 1) if during else None,
        "median_before_ms": round(1000 * statistics.median(before), 1) if before else None,
        "peak_rss_mb": round(peak_rss_mb(pid)),
        "rss_before_mb": round(rss_before),
        "peak_reset": reset,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=20.0, help="size of the hostile body")
    parser.add_argument("--shapes", default="numbers,empty_objects,tool_parameters")
    parser.add_argument("--proxy-arg", action="append", default=[], help="extra serve flag")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            parser.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    with tempfile.TemporaryDirectory(prefix="bench-big-body-") as tmp:
        store = f"sqlite:///{tmp}/capture.db"
        argv = [sys.executable, "-m", "capture_proxy", "serve", "--upstream", "fake"]
        argv += ["--store", store, "--port", "0", "--min-free-disk-mb", "64", *args.proxy_arg]
        proxy = Proc("proxy", argv, Path(tmp))
        try:
            base = proxy.url
            rows = []
            for shape in shapes:
                row = asyncio.run(run_shape(base, proxy.pid, shape, args.mib))
                rows.append(row)
                print(orjson.dumps(row).decode(), flush=True)
                if proxy.popen.poll() is not None:
                    print(f"the proxy exited with {proxy.popen.returncode}", flush=True)
                    break
        finally:
            proxy.stop()
    print()
    print("| shape | body MiB | big call | took s | worst small-call stall s | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        outcome = f"{r['status']} {r['code']}".strip()
        print(
            f"| {r['shape']} | {r['body_mib']} | {outcome} | {r['big_call_s']} | "
            f"{r['worst_stall_s']} | {r['peak_rss_mb']} |"
        )


if __name__ == "__main__":
    main()
