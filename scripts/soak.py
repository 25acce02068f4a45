"""Soak ``capture-proxy serve``: steady agent-like load for minutes; memory and descriptors.

    python -m scripts.soak --minutes 10 --concurrency 64 --store sqlite
    python -m scripts.soak --minutes 10 --concurrency 64 --store parquet

The proxy and the fake vLLM each run as their own process on loopback; this process plays
`--concurrency` sandboxes (multi-turn sessions, about half streamed, some with images). Every
`--sample-every` seconds it samples the proxy's resident memory and open file descriptors
(/proc/<pid>). At the end it stops the load, samples again, reads the proxy's counters from
``/metrics``, stops the proxy with SIGTERM and opens the store: every call acknowledged as
``staged`` must be there, the store must hold exactly as many records as the proxy counted staged,
and a sample of them must fetch and verify.

Prints each sample as a JSON line, then a JSON report with the RSS slope (MiB per minute, a
least-squares fit after the first fifth of the run), descriptors at start and end, staged counts
and latency percentiles. Exits 1 when a check fails.
``tests/reliability/test_reliability_crash.py`` runs a short variant in CI;
docs/reports/reliability.md records the 10-minute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from capture_proxy.read.reader import open_store
from tests.support.reliability_workers import Loader, open_fds, rss_mb, start_fake, start_proxy

_STAGED = re.compile(r'^capture_proxy_calls_total\{outcome="staged",reason="ok"\} (\S+)$', re.M)
_ADMIN = "soak-admin-token"
_LIVE = re.compile(r"^capture_proxy_rollouts_live (\S+)$", re.M)


@dataclass
class SoakReport:
    store: str
    minutes: float
    concurrency: int
    calls: int = 0
    calls_per_s: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    acked: int = 0
    staged_metric: int = 0  # capture_proxy_calls_total{outcome="staged"} at the end
    records_in_store: int = 0
    sealed: int = 0  # rollouts sealed through the control API during the run
    rollouts_live: int = 0  # rollouts the proxy keeps in memory at the end (capped at 10k)
    verified_sample: int = 0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_max_mb: float = 0.0
    rss_slope_mb_per_min: float = 0.0
    fds_start: int = 0
    fds_end: int = 0
    fds_max: int = 0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    stop_rc: int | None = None
    problems: list[str] = field(default_factory=list)


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    cov = sum((t - mt) * (v - mv) for t, v in samples)
    return cov / var * 60


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _check_store(url: str, acked: dict[str, str], sample: int, seed: int) -> tuple[int, int]:
    """(records in the store, acknowledged records fetched and verified); raises on a problem."""
    with open_store(url) as store:
        keys = set(store.source.all_keys())
        missing = [k for k in acked if k not in keys]
        if missing:
            raise AssertionError(f"{len(missing)} acknowledged calls are not in the store")
        chosen = random.Random(seed).sample(sorted(acked), min(sample, len(acked)))
        for record in store.fetch(chosen):
            if record.rollout_id != acked[record.call_id]:
                raise AssertionError(f"{record.call_id} is not in its rollout")
        return len(keys), len(chosen)


async def soak(
    kind: str,
    folder: Path,
    *,
    minutes: float,
    concurrency: int,
    sample_every: float = 5.0,
    seed: int = 7,
    verify_sample: int = 500,
    on_sample: Callable[[dict[str, Any]], None] | None = None,
) -> SoakReport:
    """Run the soak; the report (its `problems` list what failed)."""
    await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
    url = f"sqlite:///{folder / 'soak.db'}" if kind == "sqlite" else f"parquet:///{folder / 'ds'}"
    report = SoakReport(kind, minutes, concurrency)
    fake = start_fake(latency=0.05, chunk_delay=0.002)
    proxy = start_proxy(fake.url, url, "--log-level", "warning", "--admin-token", _ADMIN)
    # Each finished session's rollout is sealed, as a rollout driver does.
    loader = Loader(f"soak-{kind}", concurrency=concurrency, seed=seed, admin_token=_ADMIN)
    samples: list[tuple[float, float, int]] = []

    def sample(t: float) -> None:
        point = (t, rss_mb(proxy.pid), open_fds(proxy.pid))
        samples.append(point)
        if on_sample is not None:
            on_sample({"t": round(t, 1), "rss_mb": round(point[1], 1), "fds": point[2]})

    try:
        # Generous: under bench/soak_probe's tracemalloc the proxy takes a minute to start.
        base = await asyncio.to_thread(proxy.wait_ready, 180.0)
        t0 = time.monotonic()
        sample(0.0)
        loader.start(base)
        duration = minutes * 60
        while (elapsed := time.monotonic() - t0) < duration:
            await asyncio.sleep(min(sample_every, duration - elapsed))
            sample(time.monotonic() - t0)
        ran = time.monotonic() - t0
        await loader.stop(finish_within=60)
        await asyncio.sleep(1.0)  # closed client connections leave the server's fd table
        sample(time.monotonic() - t0)
        async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as resp:
            text = await resp.text()
        m = _STAGED.search(text)
        report.staged_metric = int(float(m.group(1))) if m else 0
        m = _LIVE.search(text)
        report.rollouts_live = int(float(m.group(1))) if m else 0
    finally:
        report.stop_rc = await asyncio.to_thread(proxy.terminate)
        fake.kill()
    report.sealed = loader.outcomes.pop("sealed", 0)
    report.calls = sum(loader.outcomes.values())
    report.calls_per_s = round(report.calls / ran, 1)
    report.outcomes = dict(loader.outcomes)
    report.acked = len(loader.acked)
    report.records_in_store, report.verified_sample = await asyncio.to_thread(
        _check_store, url, dict(loader.acked), verify_sample, seed
    )
    warm = [(t, r) for t, r, _ in samples if t >= ran / 5]
    report.rss_start_mb = round(samples[0][1], 1)
    report.rss_end_mb = round(samples[-1][1], 1)
    report.rss_max_mb = round(max(r for _, r, _ in samples), 1)
    report.rss_slope_mb_per_min = round(slope_per_minute(warm), 2)
    report.fds_start, report.fds_end = samples[0][2], samples[-1][2]
    report.fds_max = max(f for _, _, f in samples)
    report.latency_p50_ms = round(_percentile(loader.latencies, 0.5) * 1000, 1)
    report.latency_p99_ms = round(_percentile(loader.latencies, 0.99) * 1000, 1)
    report.problems = _problems(report)
    return report


def _problems(r: SoakReport) -> list[str]:
    problems = []
    bad = {k: v for k, v in r.outcomes.items() if k != "staged"}
    if bad:
        problems.append(f"calls that were not staged: {bad}")
    if r.stop_rc != 0:
        problems.append(f"the proxy did not stop cleanly: rc {r.stop_rc}")
    if r.records_in_store != r.staged_metric:
        problems.append(
            f"the store holds {r.records_in_store} records, the proxy counted {r.staged_metric}"
        )
    if r.acked > r.records_in_store or r.acked == 0:
        problems.append(f"{r.acked} acknowledged but {r.records_in_store} in the store")
    # Idle keep-alive connections to the upstream (at most one per concurrent call) may still
    # be pooled at the end; anything beyond them is a leak.
    if r.fds_end > r.fds_start + r.concurrency + 16:
        problems.append(f"descriptors grew from {r.fds_start} to {r.fds_end}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["sqlite", "parquet"], default="sqlite")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--max-rss-slope", type=float, default=2.0, help="MiB/min; fail above")
    parser.add_argument("--dir", type=Path, default=None, help="store folder (default: a temp dir)")
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix=f"soak-{args.store}-"))
    report = asyncio.run(
        soak(
            args.store,
            folder,
            minutes=args.minutes,
            concurrency=args.concurrency,
            sample_every=args.sample_every,
            on_sample=lambda s: print(json.dumps(s), flush=True),
        )
    )
    if args.minutes >= 5 and report.rss_slope_mb_per_min > args.max_rss_slope:
        report.problems.append(f"RSS grows {report.rss_slope_mb_per_min} MiB/min")
    print(json.dumps({"report": asdict(report), "folder": str(folder)}), flush=True)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
