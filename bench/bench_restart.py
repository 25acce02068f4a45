"""How long a restarted ``capture-proxy serve`` takes to be ready on a 10,000-unit moto dataset.

    .venv/bin/python bench/bench_restart.py [--units 10000] [--restarts 3] [--sandboxes 4]
        [--baseline PATH] [--warmup 5] [--compact-every S] [--skip-alone] [--json]

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

With `--writer-per-tree` too, the serving proxy runs each checkout's code in turn as well (a
change to what a writer commits changes the tail a restart meets): `--restarts` rounds, each a
phase per checkout (the order alternating), each from a compacted store (``capture-proxy
compact`` first: no tail), starting that checkout's serving proxy, running
the load `--warmup` seconds, then restarting a proxy of that checkout once; each says its
serving proxy's units a minute and calls a second, the tail, and the calls staged while the
restarted proxy was not ready.

With `--compact-every S`, the under-load phase is run twice, the same way, on the same store:
without maintenance, then with ``capture-proxy compact`` (the real command, in a process of its
own, taking the dataset's maintenance lease) started every `S` seconds beside the serving proxy
for the whole phase, as a deploy's schedule runs it. Each phase starts from a compacted store (one
``capture-proxy compact`` first), runs the load `--warmup` seconds, then times its restarts. Each
restart says how many units the restarted proxy's open had to read since the checkpoint (the
**tail**, counted just before it starts) and how many live units the dataset had; each
compaction its seconds, the seconds it held the lease (the lease object polled every 0.1 s),
and its units before and after.

One run, on a shared machine: figures are noisy; give the load average beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import aiohttp
import obstore
import orjson
from obstore.store import S3Store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_object_store_scale import BUCKET, _client, cached_dataset, upload

from capture_proxy.sinks.parquet._checkpoint import load_markers
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._lease import LEASE
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
        load_now = round(os.getloadavg()[0], 1)
        starting = proxy.first(r"\bstarting\b")
        banner = proxy.first(r"listening on")
        opened = proxy.first(_OPENED.pattern)
        out: dict[str, Any] = {"ready s": ready, "load average": load_now}
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


def tail_units(store: str) -> dict[str, int]:
    """The units a restarted proxy's open reads one by one (committed since the checkpoint),
    and the dataset's live units, as an open sees them now."""
    loaded = load_markers(DatasetFS(store), object_url=store)
    body = loaded.checkpoint or {"units": [], "retired": {}}
    known = {u["unit"] for u in body["units"]} | set(body["retired"])
    live = loaded.live()
    return {"tail units": sum(m.unit not in known for m in live), "live units": len(live)}


class Compactions:
    """``capture-proxy compact`` on the store every `every_s` seconds (start to start; a run
    that outlasts it is followed at once, as a schedule that forbids overlaps would)."""

    def __init__(self, store: str, lease: S3Store, every_s: float) -> None:
        self.store, self.lease, self.every_s = store, lease, every_s
        self.runs: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        started = time.monotonic()
        while True:
            t = time.monotonic()
            self.runs.append(await compact_once(self.store, self.lease, t - started))
            await asyncio.sleep(max(0.0, self.every_s - (time.monotonic() - t)))


def _lease_held(lease: S3Store) -> bool:
    try:
        body = orjson.loads(bytes(obstore.get(lease, LEASE).bytes()))
    except FileNotFoundError:
        return False
    return not body.get("released", True)


async def compact_once(
    store: str, lease: S3Store, at: float = 0.0, *, tree: Path | None = None, grace_0: bool = False
) -> dict[str, Any]:
    """One ``capture-proxy compact --json`` run (of checkout `tree`, else this one; with
    `grace_0`, ``--grace 0s``): its seconds, the seconds the lease was seen held meanwhile
    (polled every 0.1 s), its summary (with the lease it reports holding, if it does)."""
    python = sys.executable if tree is None else str(tree / ".venv" / "bin" / "python")
    argv = [python, "-m", "capture_proxy", "compact", store, "--json"]
    argv += ["--grace", "0s"] if grace_0 else []
    t = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=tree or ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    done = asyncio.create_task(proc.communicate())
    held: list[float] = []
    while not done.done():
        if await asyncio.to_thread(_lease_held, lease):
            held.append(time.monotonic())
        await asyncio.wait({done}, timeout=0.1)
    out, err = done.result()
    run: dict[str, Any] = {"at s": round(at, 1), "s": round(time.monotonic() - t, 2)}
    run["lease s"] = round(held[-1] - held[0], 2) if held else 0.0
    run["rc"] = proc.returncode
    if proc.returncode == 0:
        summary = json.loads(out.decode().strip().splitlines()[-1])
        keep = ("units_before", "units_after", "deleted_files")
        run.update({k: summary[k] for k in keep})
        run["lease s (reported)"] = summary.get("lease_held_s")
    else:
        run["error"] = err.decode()[-300:]
    return run


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 2) if values else None


async def restarts(
    upstream: str, store: str, n: int, baseline: Path | None = None, *, tail: bool = False
) -> dict[str, Any]:
    trees = {"this": ROOT} if baseline is None else {"baseline": baseline, "this": ROOT}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for _ in range(n):
            for label, code in trees.items():
                before = await asyncio.to_thread(tail_units, store) if tail else {}
                runs[label].append({**before, **await time_to_ready(upstream, store, http, code)})
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
    if any("tail units" in r for r in runs):
        out["tail units (each)"] = [r.get("tail units") for r in runs]
        out["live units (each)"] = [r.get("live units") for r in runs]
        out["load average (each)"] = [r.get("load average") for r in runs]
    return out


@dataclass(frozen=True)
class Phase:
    """How an under-load phase runs: restarts, sandboxes, the load before the first restart,
    and `capture-proxy compact` every `compact_every_s` seconds (0: never; None: no compaction
    at all, not even the first)."""

    n: int
    sandboxes: int
    warmup_s: float = 5.0
    compact_every_s: float | None = None


async def under_load(
    upstream: str, store: str, phase: Phase, baseline: Path | None, lease: S3Store
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if phase.compact_every_s is not None:  # from a compacted store, as the other phase
        out["first compaction"] = await compact_once(store, lease)
    writer = start_proxy(upstream, store, "--min-free-disk-mb", "0", cwd=ROOT)
    writer.wait_ready(170)
    # A name of its own per phase: its sandboxes' rollouts are new ones, not the last phase's.
    name = f"restart-load-{phase.compact_every_s or 0:g}"
    loader = Loader(name, concurrency=phase.sandboxes, seed=1, turns=6)
    loader.start(writer.url)
    compactions = Compactions(store, lease, phase.compact_every_s or 0.0)
    if phase.compact_every_s:
        compactions.start()
    started = time.monotonic()
    try:
        await asyncio.sleep(phase.warmup_s)  # the writer's units start to pile up
        tail = phase.compact_every_s is not None
        out.update(await restarts(upstream, store, phase.n, baseline, tail=tail))
        out["load s"] = round(time.monotonic() - started, 1)
        out["load average"] = os.getloadavg()
        out["load calls staged"] = loader.outcomes["staged"]
        out["load outcomes"] = dict(loader.outcomes)
        return out
    finally:
        await compactions.stop()
        if compactions.runs:
            out["compactions"] = compactions.runs
        await loader.stop()
        await asyncio.to_thread(writer.terminate, 30)


async def serving_tree(
    upstream: str,
    store: str,
    phase: Phase,
    code: Path,
    http: aiohttp.ClientSession,
    name: str,
    lease: S3Store,
) -> dict[str, Any]:
    """One restart under load where the serving proxy runs `code`'s checkout too: its units a
    minute (what its writer commits) make the tail the restart meets. From a compacted store
    (no tail), as every phase."""
    compacted = await compact_once(store, lease)
    writer = start_proxy(upstream, store, "--min-free-disk-mb", "0", cwd=code)
    writer.wait_ready(170)
    first = await asyncio.to_thread(tail_units, store)
    loader = Loader(name, concurrency=phase.sandboxes, seed=1, turns=6)
    loader.start(writer.url)
    started = time.monotonic()
    try:
        await asyncio.sleep(phase.warmup_s)
        before = await asyncio.to_thread(tail_units, store)
        minutes = (time.monotonic() - started) / 60
        staged = loader.outcomes["staged"]
        out: dict[str, Any] = {**before, "compaction before s": compacted["s"]}
        out["serving units/min"] = round((before["live units"] - first["live units"]) / minutes)
        out["serving calls/s"] = round(staged / minutes / 60, 1)
        out.update(await time_to_ready(upstream, store, http, code))
        out["calls staged meanwhile"] = loader.outcomes["staged"] - staged
        return out
    finally:
        await loader.stop()
        await asyncio.to_thread(writer.terminate, 30)


async def per_tree(
    upstream: str, store: str, phase: Phase, baseline: Path, lease: S3Store
) -> dict[str, Any]:
    """`phase.n` rounds; in each, the baseline's serving proxy and restart and this
    checkout's, in turn (the order alternating), each from a compacted store."""
    trees = {"baseline": baseline, "this": ROOT}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for i in range(phase.n):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for label in order:
                name = f"restart-load-{label}-{i}"
                runs[label].append(
                    await serving_tree(upstream, store, phase, trees[label], http, name, lease)
                )
    out: dict[str, Any] = {}
    for label, r in runs.items():
        out[label] = _summary(r)
        for key in ("serving units/min", "serving calls/s", "calls staged meanwhile"):
            out[label][f"{key} (each)"] = [x[key] for x in r]
    return out


async def run(
    units: int,
    phase: Phase,
    baseline: Path | None,
    *,
    alone: bool = True,
    writer_per_tree: bool = False,
) -> dict[str, Any]:
    local, built_s = cached_dataset(units)
    out: dict[str, Any] = {"units": units, "built s": built_s, "load average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, MotoS3(Path(tmp), BUCKET) as moto:
        os.environ.update(moto.env)  # the proxies are started with it in their environment
        t = time.perf_counter()
        target = S3Store(BUCKET, prefix="ds", **_client(moto))
        out["uploaded objects"] = await asyncio.to_thread(upload, local, target)
        out["upload s"] = time.perf_counter() - t
        store = f"s3://{BUCKET}/ds"
        lease = S3Store(BUCKET, prefix="ds", **_client(moto))
        fake = start_fake(latency=0.02)
        try:
            if alone:
                out["alone"] = await restarts(fake.url, store, phase.n, baseline)
                out["alone"]["load average"] = os.getloadavg()
            if phase.sandboxes and writer_per_tree and baseline is not None:
                out["under load, serving proxy per tree"] = await per_tree(
                    fake.url, store, phase, baseline, lease
                )
            elif phase.sandboxes and phase.compact_every_s is None:
                out["under load"] = await under_load(fake.url, store, phase, baseline, lease)
            elif phase.sandboxes:
                never = replace(phase, compact_every_s=0.0)
                out["under load"] = await under_load(fake.url, store, never, baseline, lease)
                label = f"under load, compact every {phase.compact_every_s:g} s"
                out[label] = await under_load(fake.url, store, phase, baseline, lease)
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
    ap.add_argument(
        "--warmup", type=float, default=5.0, help="seconds of load before the first restart"
    )
    ap.add_argument(
        "--compact-every",
        type=float,
        metavar="S",
        help="also run the under-load phase with `capture-proxy compact` every S seconds",
    )
    ap.add_argument(
        "--writer-per-tree",
        action="store_true",
        help="with --baseline: the serving proxy runs each checkout's code too, in turn",
    )
    ap.add_argument("--skip-alone", action="store_true", help="no restarts without load")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    phase = Phase(args.restarts, args.sandboxes, args.warmup, args.compact_every)
    result = asyncio.run(
        run(
            args.units,
            phase,
            args.baseline,
            alone=not args.skip_alone,
            writer_per_tree=args.writer_per_tree,
        )
    )
    if args.json:
        print(json.dumps(result))
        return
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
