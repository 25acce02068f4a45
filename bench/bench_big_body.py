"""Large hostile requests against a real proxy process, while another client is served.

    .venv/bin/python bench/bench_big_body.py                      # 20 MiB of numbers, then of {}
    .venv/bin/python bench/bench_big_body.py --mib 60 --shapes empty_objects
    .venv/bin/python bench/bench_big_body.py --mib 62 --at-once 3 \
        --shapes empty_messages,tiny_messages,content_parts,logit_bias,images

Starts ``capture-proxy serve --upstream fake`` with a SQLite store in a temporary folder. For each
shape, one client sends `--at-once` requests of about `--mib` MiB at the same time, each holding
millions of small values (``chat_template_kwargs`` full of small numbers or empty objects, one
tool's ``parameters`` full of them, ``messages`` of empty objects or of tiny valid messages, one
message's content parts, ``logit_bias`` keys) or, for comparison, an honest body of that size
(``images``: one user message of 5 MiB PNG images), while a second client sends small calls one
after another and records each call's latency. Reported per shape: the worst and the median
latency of the small client's calls while the big calls were in flight (how long the event loop
froze), the proxy's peak RSS during the shape (VmHWM, reset before it where the kernel allows),
the big calls' HTTP statuses and error codes, and how long they took. Loopback only; every loop is
bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import multiprocessing
import statistics
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from bench_proxy import Proc  # bench/ is a folder of scripts run by path: siblings import flat
from procstat import peak_rss_mb, reset_peak_rss, rss_mb

SHAPES = (
    "numbers",
    "empty_objects",
    "tool_parameters",
    "empty_messages",
    "tiny_messages",
    "content_parts",
    "logit_bias",
    "images",
)
_SMALL = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _png(side: int, seed: int) -> bytes:
    """A valid PNG of `side` x `side` noisy RGB pixels, stored (not compressed): ~3 bytes/pixel."""
    rows = bytes(((x * 7 + y * 13 + seed) * 31) % 251 for x in range(side * 3) for y in range(1))
    raw = b"".join(b"\x00" + rows for _ in range(side))
    head = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    png = chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw, 0)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + png


_LAST = b'{"role":"user","content":"hi"}'
_HI = b'"messages":[' + _LAST + b"]"


def _messages_body(target: int, item: bytes) -> bytes:
    fill = item * (target // len(item))
    return b'{"model":"policy","max_tokens":4,"messages":[' + fill + _LAST + b"]}"


def hostile_body(shape: str, mib: float) -> bytes:
    """A chat request of about `mib` MiB: millions of tiny values, or an honest image body."""
    target = int(mib * 2**20)
    if shape == "empty_messages":
        return _messages_body(target, b"{},")
    if shape == "tiny_messages":
        return _messages_body(target, b'{"role":"user","content":"x"},')
    if shape == "content_parts":
        parts = b"{}," * (target // 3)
        return (
            b'{"model":"policy","max_tokens":4,"messages":[{"role":"user","content":['
            + parts
            + b'{"type":"text","text":"hi"}]}]}'
        )
    if shape == "logit_bias":
        # Distinct keys (a JSON object keeps the last of repeated ones): 2 M of them at 62 MiB.
        keys = b",".join(b'"%d":1' % i for i in range(target // 12))
        return b'{"model":"policy","max_tokens":4,"logit_bias":{' + keys + b"}," + _HI + b"}"
    if shape == "images":
        png = base64.b64encode(_png(1290, 0))  # ~5 MiB of base64
        part = b'{"type":"image_url","image_url":{"url":"data:image/png;base64,' + png + b'"}},'
        parts = part * max(1, target // len(part))
        return (
            b'{"model":"policy","max_tokens":4,"messages":[{"role":"user","content":['
            + parts
            + b'{"type":"text","text":"what is in these?"}]}]}'
        )
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


async def _small_calls(url: str, stop: Any, seconds: float) -> list[tuple[float, float]]:
    """Small calls back to back until `stop` is set (bounded in count and time)."""
    out: list[tuple[float, float]] = []
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:
        for _ in range(100_000):
            if stop.is_set() or time.monotonic() > deadline:
                break
            t = time.monotonic()
            async with session.post(url, json=_SMALL) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            out.append((t, time.monotonic() - t))
    return out


def _small_client(url: str, stop: Any, results: Any) -> None:
    """The small client, in a process of its own: the big bodies the bench sends from its own
    event loop must not delay it (CLOCK_MONOTONIC is the same clock in every process)."""
    results.put(asyncio.run(_small_calls(url, stop, 600.0)))


async def _big_call(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, str]:
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            answer = await resp.read()
            if resp.status == 200:
                return 200, ""
            return resp.status, str(orjson.loads(answer).get("error", {}).get("code", ""))
    except aiohttp.ClientError as e:
        return 0, type(e).__name__


async def run_shape(
    base: str, pid: int, shape: str, mib: float, at_once: int = 1
) -> dict[str, Any]:
    body = hostile_body(shape, mib)
    reset = reset_peak_rss(pid)
    rss_before = rss_mb(pid)
    timeout = aiohttp.ClientTimeout(total=300)
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    small_url = f"{base}/r/small-{shape}/v1/chat/completions"
    small = context.Process(target=_small_client, args=(small_url, stop, results))
    small.start()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.sleep(2.0)  # the small client's start and baseline
        t0 = time.monotonic()
        url = f"{base}/r/big-{shape}/v1/chat/completions"
        results_big = await asyncio.gather(*(_big_call(session, url, body) for _ in range(at_once)))
        outcomes = sorted({f"{status} {code}".strip() for status, code in results_big})
        t1 = time.monotonic()
        big_s = t1 - t0
        await asyncio.sleep(1.0)
    stop.set()
    lat: list[tuple[float, float]] = results.get(timeout=60)
    small.join(timeout=60)
    during = [d for (t, d) in lat if t0 - 0.001 <= t + d and t <= t1]
    before = [d for (t, d) in lat if t + d < t0]
    return {
        "shape": shape,
        "body_mib": round(len(body) / 2**20, 1),
        "at_once": at_once,
        "outcome": ", ".join(outcomes),
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
    parser.add_argument("--at-once", type=int, default=1, help="hostile bodies sent together")
    parser.add_argument("--proxy-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument(
        "--upstream",
        default="fake",
        help="the proxy's upstream: 'fake' (the bundled fake vLLM inside the proxy's process, "
        "which then parses every body again) or the URL of one running apart, as vLLM does "
        "(python -m capture_proxy.fake_vllm --port 0 --model policy)",
    )
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            parser.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    with tempfile.TemporaryDirectory(prefix="bench-big-body-") as tmp:
        store = f"sqlite:///{tmp}/capture.db"
        argv = [sys.executable, "-m", "capture_proxy", "serve", "--upstream", args.upstream]
        argv += ["--store", store, "--port", "0", "--min-free-disk-mb", "64", *args.proxy_arg]
        proxy = Proc("proxy", argv, Path(tmp))
        try:
            base = proxy.url
            rows = []
            for shape in shapes:
                row = asyncio.run(run_shape(base, proxy.pid, shape, args.mib, args.at_once))
                rows.append(row)
                print(orjson.dumps(row).decode(), flush=True)
                if proxy.popen.poll() is not None:
                    print(f"the proxy exited with {proxy.popen.returncode}", flush=True)
                    break
        finally:
            proxy.stop()
    print()
    print(
        "| shape | body MiB | at once | big calls | took s | worst small-call latency s | "
        "RSS before MB | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['body_mib']} | {r['at_once']} | {r['outcome']} | "
            f"{r['big_call_s']} | {r['worst_stall_s']} | {r['rss_before_mb']} | "
            f"{r['peak_rss_mb']} |"
        )


if __name__ == "__main__":
    main()
