"""What ``--store-linger`` costs a call and saves the store: units a minute against call latency.

    .venv/bin/python bench/bench_linger.py [--linger 0 0.1 0.25] [--seconds 20] [--rounds 1]
        [--sandboxes 4] [--json]

A proxy writes a Parquet dataset on a moto S3 server on loopback while `--sandboxes` agent-like
sandboxes (`tests/support/reliability_workers.Loader`, the bundled fake vLLM as a process, 20 ms
latency, as in bench/bench_restart.py) call it for `--seconds`; once per `--linger` value in turn,
`--rounds` times (the values alternate, so the machine's load meets each alike), each on a
dataset of its own. Reported per value: calls staged a second, **units committed a minute**
(the commit markers listed at the end), calls per unit, the calls' latency as the sandboxes saw
it (p50, p99), the proxy's stage latency (``capture_proxy_stage_duration_seconds``, p50 and p99
interpolated in its buckets), and the load average.

A unit is what a restarted proxy's open, the follower of every other proxy and the next
compaction each read one by one (docs/storage.md, "A compaction every minute").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from capture_proxy.sinks.parquet._checkpoint import load_markers
from capture_proxy.sinks.parquet._fs import DatasetFS
from tests.support.reliability_workers import Loader, start_fake, start_proxy
from tests.support.s3 import MotoS3

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "linger"
_STAGE = "capture_proxy_stage_duration_seconds_bucket"


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """`q` of a Prometheus histogram's cumulative (bound, count) pairs, linear in a bucket."""
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    want = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= want:
            if bound == float("inf"):
                return prev_bound
            span = count - prev_count
            frac = (want - prev_count) / span if span else 0.0
            return prev_bound + frac * (bound - prev_bound)
        prev_bound, prev_count = bound, count
    return prev_bound


async def _stage_buckets(http: aiohttp.ClientSession, url: str) -> list[tuple[float, float]]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith(_STAGE):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((float(le), float(line.rsplit(" ", 1)[1])))
    return sorted(out)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one(
    upstream: str, store: str, linger: float, seconds: float, sandboxes: int
) -> dict[str, Any]:
    proxy = start_proxy(upstream, store, "--store-linger", str(linger), cwd=ROOT)
    try:
        proxy.wait_ready(120)
        loader = Loader(f"linger-{linger:g}", concurrency=sandboxes, seed=1, turns=6)
        loader.start(proxy.url)
        t = time.monotonic()
        await asyncio.sleep(seconds)
        await loader.stop(finish_within=5)
        took = time.monotonic() - t
        async with aiohttp.ClientSession() as http:
            buckets = await _stage_buckets(http, proxy.url)
    finally:
        await asyncio.to_thread(proxy.terminate, 30)
    units = len(load_markers(DatasetFS(store), object_url=store).live())
    staged = loader.outcomes["staged"]
    return {
        "linger s": linger,
        "calls staged/s": round(staged / took, 2),
        "units/min": round(units / took * 60),
        "calls per unit": round(staged / units, 2) if units else None,
        "call p50 ms": round(1000 * (_pct(loader.latencies, 0.5) or 0), 1),
        "call p99 ms": round(1000 * (_pct(loader.latencies, 0.99) or 0), 1),
        "stage p50 ms": round(1000 * (_quantile(buckets, 0.5) or 0), 1),
        "stage p99 ms": round(1000 * (_quantile(buckets, 0.99) or 0), 1),
        "outcomes": dict(loader.outcomes),
        "load average": round(os.getloadavg()[0], 1),
    }


async def run(lingers: list[float], seconds: float, rounds: int, sandboxes: int) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {f"{v:g}": [] for v in lingers}
    with tempfile.TemporaryDirectory() as tmp, MotoS3(Path(tmp), BUCKET) as moto:
        os.environ.update(moto.env)  # the proxies are started with it in their environment
        fake = start_fake(latency=0.02)
        try:
            for r in range(rounds):
                for v in lingers:
                    store = f"s3://{BUCKET}/ds-{r}-{v:g}"
                    results[f"{v:g}"].append(await one(fake.url, store, v, seconds, sandboxes))
        finally:
            fake.terminate()
    summary: dict[str, Any] = {}
    for label, runs in results.items():
        keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
        summary[label] = {
            k: statistics.median(r[k] for r in runs if r[k] is not None) for k in keys
        }
        summary[label]["runs"] = runs
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--linger", type=float, nargs="+", default=[0.0, 0.1, 0.25])
    ap.add_argument("--seconds", type=float, default=20.0, help="load per run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--sandboxes", type=int, default=4)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    out = asyncio.run(run(args.linger, args.seconds, args.rounds, args.sandboxes))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for v, s in out.items():
        fields = ", ".join(f"{k} {s[k]}" for k in s if k != "runs")
        print(f"--store-linger {v}: {fields}")


if __name__ == "__main__":
    main()
