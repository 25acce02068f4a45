"""Sandboxes moved between proxies on one object-store dataset under load: stage timeouts and
poisoned rollouts, and where a writer's time goes at a hand-off.

    .venv/bin/python bench/bench_handoff_load.py [--proxies 3] [--sandboxes 24] [--calls 12]
        [--hop 3] [--stage-timeout 10] [--json]

On moto's S3 server (a subprocess on 127.0.0.1), `--proxies` proxies (in this process, each
with its own fake vLLM, as the tests run them) share one ``s3://`` dataset. `--sandboxes`
sandboxes run at once, `--calls` calls each, and each moves to the next proxy every `--hop`
calls (a hand-off; it comes back to a proxy that still holds its old state: a hand-back).
Reported: the calls' answers (``X-Capture-Status`` and the reasons of those not staged), how
many rollouts a trainer finds poisoned or with seqs that are not 0..n-1, the calls' latency,
and the time the writer threads spent in `LiveRollouts._resolve` for rollouts they did not hold
(``resolve_*``: every call queued behind it waits as long; ``writer_thread_resolves``: how many
of those read the store there, the sinks' ``writer_thread_resolves_total``, -1 before it existed).

One run on a shared machine: compare runs with the same arguments, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support: moto's server, the in-process proxies

from capture_proxy.read.reader import Store  # noqa: E402
from capture_proxy.sinks.parquet import ParquetSink  # noqa: E402
from capture_proxy.sinks.parquet._live import LiveRollouts  # noqa: E402
from capture_proxy.sinks.registry import open_sink, open_source  # noqa: E402
from tests.support.proxy_harness import (  # noqa: E402
    Proxy,
    chat_body,
    start_proxy,
    stop_proxy,
    user,
)
from tests.support.s3 import MotoS3  # noqa: E402

#: Seconds each writer thread spent in store reads for rollouts it did not hold, by thread name.
_RESOLVES: dict[str, list[float]] = collections.defaultdict(list)


def _time_resolves() -> None:
    """Time the writer's in-thread store reads (`LiveRollouts._resolve`), whichever thread runs
    them."""
    resolve = LiveRollouts._resolve

    def timed(self: LiveRollouts, rollout_id: str) -> Any:
        started = time.perf_counter()
        try:
            return resolve(self, rollout_id)
        finally:
            _RESOLVES[threading.current_thread().name].append(time.perf_counter() - started)

    LiveRollouts._resolve = timed  # type: ignore[method-assign]


async def _sandbox(
    proxies: list[Proxy], n: int, calls: int, hop: int, answers: collections.Counter[str]
) -> list[float]:
    rollout = f"sb-{n}"
    history: list[dict[str, Any]] = []
    took: list[float] = []
    for i in range(calls):
        proxy = proxies[(n + i // hop) % len(proxies)]
        history.append(user(f"turn {i}"))
        for _ in range(20):  # a 503 with Retry-After is retried, as the agents do
            started = time.perf_counter()
            resp = await proxy.chat(chat_body(*history), rollout=rollout)
            body = await resp.json()
            took.append(time.perf_counter() - started)
            status = resp.headers.get("X-Capture-Status", "")
            if resp.status == 503:
                answers[f"503 {body.get('error', {}).get('code', '')}"] += 1
                await asyncio.sleep(0.2)
                continue
            answers[f"{resp.status} {status}"] += 1
            break
        if resp.status != 200:
            history.pop()
            continue
        history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return took


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    _time_resolves()
    with tempfile.TemporaryDirectory() as tmp, MotoS3(Path(tmp) / "moto") as moto:
        old = moto.apply_env()
        url = moto.url()
        proxies = [
            await start_proxy(
                Path(tmp) / f"p{i}",
                sink=open_sink(url),
                store=url,
                stage_timeout=args.stage_timeout,
            )
            for i in range(args.proxies)
        ]
        answers: collections.Counter[str] = collections.Counter()
        started = time.perf_counter()
        try:
            took = await asyncio.gather(
                *(
                    _sandbox(proxies, n, args.calls, args.hop, answers)
                    for n in range(args.sandboxes)
                )
            )
            wall = time.perf_counter() - started
            metrics = [await (await p.client.get("/metrics")).text() for p in proxies]
            in_writer = sum(
                p.sink.stats().get("writer_thread_resolves_total", -1)
                for p in proxies
                if isinstance(p.sink, ParquetSink)
            )
        finally:
            for p in proxies:
                await stop_proxy(p)
        reasons: collections.Counter[str] = collections.Counter()
        poisoned = gaps = 0
        with Store(open_source(url)) as store:
            for n in range(args.sandboxes):
                rollout = f"sb-{n}"
                for f in store.failures(rollout):
                    reasons[f"{f.status} {f.reason}"] += 1
                status = store.status(rollout)
                poisoned += bool(status.poisoned)
                seqs = [
                    c.seq for c in store.calls(rollout, include_open=True, include_poisoned=True)
                ]
                gaps += seqs != list(range(len(seqs)))
        MotoS3.restore_env(old)
    flat = sorted(t for ts in took for t in ts)
    resolves = sorted(t for ts in _RESOLVES.values() for t in ts)
    moves = sum(
        float(line.split()[-1])
        for m in metrics
        for line in m.splitlines()
        if line.startswith("capture_proxy_stale_rollout_moves_total")
    )
    return {
        "proxies": args.proxies,
        "sandboxes": args.sandboxes,
        "calls_each": args.calls,
        "hop": args.hop,
        "stage_timeout_s": args.stage_timeout,
        "wall_s": round(wall, 1),
        "answers": dict(answers),
        "not_staged": dict(reasons),
        "poisoned_rollouts": poisoned,
        "rollouts_with_seq_gaps": gaps,
        "moved_calls": moves,
        "call_p50_ms": round(1000 * statistics.median(flat), 1),
        "call_p99_ms": round(1000 * flat[int(0.99 * (len(flat) - 1))], 1),
        "call_max_ms": round(1000 * flat[-1], 1),
        "resume_timeouts": sum(
            float(line.split()[-1])
            for m in metrics
            for line in m.splitlines()
            if line.startswith("capture_proxy_rollout_resume_timeouts_total")
        ),
        "writer_thread_resolves": in_writer,
        "resolves_on": sorted({name.split()[0] for name in _RESOLVES}),
        "resolves": len(resolves),
        "resolve_total_s": round(sum(resolves), 2),
        "resolve_max_ms": round(1000 * resolves[-1], 1) if resolves else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proxies", type=int, default=3)
    parser.add_argument("--sandboxes", type=int, default=24)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--hop", type=int, default=3)
    parser.add_argument("--stage-timeout", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
