"""How long a restarted ``capture-proxy serve`` takes to be ready on a 10,000-unit moto dataset.

    .venv/bin/python bench/bench_restart.py [--units 10000] [--restarts 3] [--sandboxes 4]
        [--baseline PATH] [--json]

The dataset is bench/bench_object_store_scale.py's (built once into the project's cache, then
uploaded to a fresh moto server on loopback: 10,000 one-call units compacted into one merged unit,
every retired marker still listed, the checkpoint in place). A proxy process is started on it
`--restarts` times, each stopped (SIGTERM) before the next, and timed from the process's start to
the first ``/readyz`` answered 200 (polled every 50 ms); the median is reported, with where the
time went, from the process's own output as it arrived:

- **imports**: start to the ``starting`` log line (the interpreter, capture_proxy's imports,
  the settings);
- **store open**: the proxy's ``store ... opened in`` log line (the `ParquetSink` open: the
  listing of the markers, the checkpoint, the index of the live units);
- **to banner**: ``starting`` to the ``listening on`` banner (the store open, the weight version
  read from the store, the listener);
- **store opened to banner**: what follows the open before the proxy listens (the weight
  version read from the store);
- **banner to ready**: the banner to the first ``/readyz`` 200 (the upstream's facts).

Twice: **alone**, then **under load**: another proxy on the same dataset serves `--sandboxes`
agent-like sandboxes (`tests/support/reliability_workers.Loader`, the bundled fake vLLM as a
process) for the whole phase, committing units the restarted proxy's open must index.

With `--baseline PATH` (another checkout of capture-proxy, `git worktree add /tmp/base main`
say), each restart is made twice in turn, once with this checkout's code and once with that one's
(the proxy process started in its folder), on the same store under the same load: a comparison
side by side in one run, as the store's tail and the machine's load change during it. The
figures of each are reported apart (``this`` and ``baseline``).

One run, on a shared machine: figures are noisy; give the load average beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import aiohttp
from obstore.store import S3Store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_object_store_scale import BUCKET, _client, cached_dataset, upload

from tests.support.reliability_workers import (
    Loader,
    Spawned,
    start_fake,
    start_proxy,
)
from tests.support.s3 import MotoS3

ROOT = Path(__file__).resolve().parents[1]
_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
_OPENED = re.compile(r"store .* opened in ([0-9.]+) s")


class Stamped(Spawned):
    """`Spawned` that also notes when each line of output arrived (monotonic seconds)."""

    def __init__(self, argv: Sequence[str], ready: re.Pattern[str], *, cwd: Path | None = None):
        self.started = time.monotonic()
        self.stamps: list[tuple[float, str]] = []
        super().__init__(argv, ready, cwd=cwd)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stamps.append((time.monotonic() - self.started, line.rstrip("\n")))
            self.lines.append(line.rstrip("\n"))
            m = self._ready_pattern.search(line)
            if m and not self._ready.is_set():
                self.url = m.group(1)
                self._ready.set()

    def first(self, pattern: str) -> tuple[float, str] | None:
        for at, line in self.stamps:
            if re.search(pattern, line):
                return at, line
        return None


def spawn_proxy(upstream: str, store: str, code: Path = ROOT) -> Stamped:
    """A proxy started in `code`'s folder: ``-m capture_proxy`` imports that checkout's code."""
    argv = [sys.executable, "-m", "capture_proxy", "serve", "--upstream", upstream]
    argv += ["--store", store, "--port", "0", "--min-free-disk-mb", "0"]
    return Stamped(argv, _LISTENING, cwd=code)


async def time_to_ready(
    upstream: str, store: str, http: aiohttp.ClientSession, code: Path = ROOT
) -> dict[str, Any]:
    proxy = spawn_proxy(upstream, store, code)
    try:
        while not proxy.url:
            if proxy.proc.poll() is not None or time.monotonic() - proxy.started > 170:
                raise RuntimeError(f"the proxy did not start:\n{proxy.output()}")
            await asyncio.sleep(0.02)
        while True:
            try:
                async with http.get(f"{proxy.url}/readyz") as resp:
                    await resp.read()
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() - proxy.started > 170:
                raise RuntimeError(f"the proxy was not ready:\n{proxy.output()}")
            await asyncio.sleep(0.05)
        ready = time.monotonic() - proxy.started
        starting = proxy.first(r"\bstarting\b")
        banner = proxy.first(r"listening on")
        opened = proxy.first(_OPENED.pattern)
        out: dict[str, Any] = {"ready s": ready}
        out["imports s"] = starting[0] if starting else None
        m = _OPENED.search(opened[1]) if opened else None
        out["store open s"] = float(m.group(1)) if m else None
        if starting and banner:
            out["starting to banner s"] = banner[0] - starting[0]
        if opened and banner:
            out["store opened to banner s"] = banner[0] - opened[0]
        if banner:
            out["banner to ready s"] = ready - banner[0]
        return out
    finally:
        await asyncio.to_thread(proxy.terminate, 30)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 2) if values else None


async def restarts(
    upstream: str, store: str, n: int, baseline: Path | None = None
) -> dict[str, Any]:
    trees = {"this": ROOT} if baseline is None else {"baseline": baseline, "this": ROOT}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for _ in range(n):
            for label, code in trees.items():
                runs[label].append(await time_to_ready(upstream, store, http, code))
    if baseline is None:
        return _summary(runs["this"])
    return {label: _summary(r) for label, r in runs.items()}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "ready s",
        "imports s",
        "store open s",
        "starting to banner s",
        "store opened to banner s",
        "banner to ready s",
    )
    out: dict[str, Any] = {f"{k} (median)": _median(runs, k) for k in keys}
    out["ready s (each)"] = [round(r["ready s"], 2) for r in runs]
    return out


async def under_load(
    upstream: str, store: str, n: int, sandboxes: int, baseline: Path | None
) -> dict[str, Any]:
    writer = start_proxy(upstream, store, "--min-free-disk-mb", "0", cwd=ROOT)
    writer.wait_ready(170)
    loader = Loader("restart-load", concurrency=sandboxes, seed=1, turns=6)
    loader.start(writer.url)
    try:
        await asyncio.sleep(5)  # the writer's units start to pile up
        out = await restarts(upstream, store, n, baseline)
        out["load average"] = os.getloadavg()
        out["load calls staged"] = loader.outcomes["staged"]
        out["load outcomes"] = dict(loader.outcomes)
        return out
    finally:
        await loader.stop()
        await asyncio.to_thread(writer.terminate, 30)


async def run(units: int, n: int, sandboxes: int, baseline: Path | None) -> dict[str, Any]:
    local, built_s = cached_dataset(units)
    out: dict[str, Any] = {"units": units, "built s": built_s, "load average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, MotoS3(Path(tmp), BUCKET) as moto:
        os.environ.update(moto.env)  # the proxies are started with it in their environment
        t = time.perf_counter()
        target = S3Store(BUCKET, prefix="ds", **_client(moto))
        out["uploaded objects"] = await asyncio.to_thread(upload, local, target)
        out["upload s"] = time.perf_counter() - t
        store = f"s3://{BUCKET}/ds"
        fake = start_fake(latency=0.02)
        try:
            out["alone"] = await restarts(fake.url, store, n, baseline)
            out["alone"]["load average"] = os.getloadavg()
            if sandboxes:
                out["under load"] = await under_load(fake.url, store, n, sandboxes, baseline)
        finally:
            fake.terminate()
    out["load average after"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", type=int, default=10_000, help="units committed (default 10000)")
    ap.add_argument("--restarts", type=int, default=3, help="restarts timed per phase")
    ap.add_argument("--sandboxes", type=int, default=4, help="sandboxes on the other proxy")
    ap.add_argument(
        "--baseline",
        type=Path,
        help="another checkout whose proxy is restarted in turn with this one's (compared)",
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    result = asyncio.run(run(args.units, args.restarts, args.sandboxes, args.baseline))
    if args.json:
        print(json.dumps(result))
        return
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
