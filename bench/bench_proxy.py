"""capture-proxy against a direct connection and a minimal aiohttp pass-through, side by side.

    .venv/bin/python bench/bench_proxy.py           # the full suite (about 15 minutes)
    .venv/bin/python bench/bench_proxy.py --quick   # CI: under 2 minutes; exits 0, prints a table

Every process under test runs on its own, on loopback: the fast vLLM-shaped upstream
(`upstream_fixture.py`, pre-built answers), the minimal pass-through (`passthrough.py`),
``capture-proxy serve`` with the SQLite store and with the Parquet store, and for each run a
load generator (`loadgen.py`). "direct" is the load generator talking to the upstream itself.

Each scenario runs every target once per repeat, in rotating order, with the same arrival
schedule for all targets of a repeat. Per run: CPU ms per call of the target process (all its
threads, from /proc/<pid>/stat), latency p50/p99 and time to first body byte, throughput and peak
RSS (VmHWM, reset before the run). "added" is the target's figure minus direct's in the same
repeat; the table shows medians over repeats, and ratios to the pass-through are medians of the
per-repeat ratios (this machine is shared and noisy: trust ratios and medians, not single runs).

The token-in scenarios (``token-in-*``) run in front of the bundled fake vLLM with its scale-out
routes (`fake_upstream.py`) and replay agent sessions (`session_load.py`: each call extends the
previous one, as OpenCode's do), against "direct", "sqlite" (the plain captured call) and
"token-in" (the same proxy with ``--token-in on``: render, generate and derender upstream, the
bridge in between). Their ratios are to the plain captured call of the same repeat: CPU per call
and added p50 (the goal: at most 1.5x the CPU, at most 5 ms more added p50).

Options: ``--json PATH`` keeps every run's figures, ``--markdown PATH`` writes the table,
``--plot PATH`` draws added latency against concurrency (needs matplotlib, a bench-only
dependency), ``--scenarios a,b`` runs a subset, ``--targets`` likewise, ``--repeats N``.
Before/after in one run: ``--base PATH`` (another checkout with its own ``.venv``) and the
targets ``base-sqlite``/``base-parquet``/``base-token-in`` run that checkout's proxy beside this
one's, in the same rotation; ``sqlite-asyncio``/``parquet-asyncio`` run this one on asyncio's
loop (``--loop asyncio``). The table then adds each target's CPU and added p50 as ratios to its
base.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

# bench/ is a folder of scripts run by path (`python bench/bench_proxy.py`): Python puts the
# script's folder first on sys.path, so its siblings import by name.
from procstat import cpu_seconds, peak_rss_mb, reset_peak_rss
from report import render_markdown, summarize

HERE = Path(__file__).resolve().parent

PY = sys.executable
TARGETS = ("direct", "passthrough", "sqlite", "parquet", "token-in")
#: Proxy targets beside those: the same store on asyncio's loop (``--loop asyncio``), and the
#: store served by another checkout (``--base PATH``: its ``.venv``), for A/B runs in one go.
VARIANTS = ("sqlite-asyncio", "parquet-asyncio", "base-sqlite", "base-parquet", "base-token-in")


@dataclass(frozen=True)
class Phase:
    """An upstream configuration; the targets are started in front of it once per phase."""

    name: str
    delay: float  # service time before the first byte
    tick: float  # seconds between stream writes
    events_per_write: int
    #: The upstream: the pre-built answers, or the fake vLLM with its token-in routes.
    upstream: str = "upstream_fixture.py"
    #: The targets this phase runs (of those asked for).
    targets: tuple[str, ...] = ("direct", "passthrough", "sqlite", "parquet", *VARIANTS)
    #: The load generator: fixed requests (`loadgen.py`) or replayed sessions.
    load: str = "loadgen.py"

    def upstream_args(self, loop: str) -> list[str]:
        if self.upstream == "fake_upstream.py":
            return ["--latency", str(self.delay), "--loop", loop]
        return [
            "--delay",
            str(self.delay),
            "--tick",
            str(self.tick),
            "--events-per-write",
            str(self.events_per_write),
            "--loop",
            loop,
        ]


@dataclass(frozen=True)
class Scenario:
    name: str
    phase: str
    stream: bool
    mode: str  # poisson | closed
    rate: float = 0.0
    concurrency: int = 0
    duration: float = 8.0
    about: str = ""
    drain: float | None = None  # None: the run's default (DRAIN)
    rollouts: int = 0  # interleaved sessions (0: the load generator's default, 32)

    def load_args(self) -> list[str]:
        args = ["--mode", self.mode, "--duration", str(self.duration)]
        if self.rollouts:
            args += ["--rollouts", str(self.rollouts)]
        if self.mode == "poisson":
            args += ["--rate", str(self.rate)]
        else:
            args += ["--concurrency", str(self.concurrency)]
        return [*args, "--stream"] if self.stream else args


PHASES = {
    "200ms": Phase("200ms", delay=0.2, tick=0.001, events_per_write=1),
    "fast": Phase("fast", delay=0.0, tick=0.001, events_per_write=1),
    # 256 streams at once: fresh processes (their RSS is the streams', not earlier runs' state),
    # and 16 token events per write so the upstream itself keeps up on two cores.
    "burst": Phase("burst", delay=0.0, tick=0.002, events_per_write=16),
    # Token-in beside the plain captured call: sessions replayed against the fake vLLM.
    "fake": Phase(
        "fake",
        delay=0.0,
        tick=0.0,
        events_per_write=1,
        upstream="fake_upstream.py",
        targets=("direct", "sqlite", "token-in", "base-sqlite", "base-token-in"),
        load="session_load.py",
    ),
}


def scenarios(quick: bool) -> list[Scenario]:
    if quick:
        return [
            Scenario("unary-200ms-poisson100", "200ms", False, "poisson", rate=100, duration=4),
            Scenario("unary-200ms-sequential", "200ms", False, "closed", concurrency=1, duration=6),
            Scenario(
                "unary-200ms-one-session",
                "200ms",
                False,
                "closed",
                concurrency=1,
                duration=6,
                rollouts=1,
            ),
            Scenario("stream-200ms-poisson5", "200ms", True, "poisson", rate=5, duration=4),
            Scenario("unary-200ms-closed64", "200ms", False, "closed", concurrency=64, duration=3),
            Scenario("token-in-fake-closed1", "fake", False, "closed", concurrency=1, duration=4),
        ]
    return [
        Scenario(
            "unary-200ms-poisson100",
            "200ms",
            False,
            "poisson",
            rate=100,
            about="latency: 200 ms upstream, Poisson arrivals at 100 calls/s (DESIGN §9)",
        ),
        Scenario(
            "unary-200ms-poisson20",
            "200ms",
            False,
            "poisson",
            rate=20,
            about="the same at 20 calls/s: added latency without CPU saturation",
        ),
        Scenario(
            "unary-200ms-sequential",
            "200ms",
            False,
            "closed",
            concurrency=1,
            duration=10,
            about="one call at a time (~5/s behind the 200 ms upstream): the durable commit's "
            "share of a call's latency; each call is the first of its rollout (32 sessions)",
        ),
        Scenario(
            "unary-200ms-one-session",
            "200ms",
            False,
            "closed",
            concurrency=1,
            duration=10,
            rollouts=1,
            about="the same, one agent session: every call after the first continues its "
            "rollout, as one agent's calls do",
        ),
        Scenario(
            "stream-200ms-poisson10",
            "200ms",
            True,
            "poisson",
            rate=10,
            about="streams: 200 ms to the first chunk, then 1k token chunks ~1 ms apart",
        ),
        Scenario("unary-fast-closed1", "fast", False, "closed", concurrency=1, duration=5),
        Scenario("unary-fast-closed16", "fast", False, "closed", concurrency=16, duration=5),
        Scenario("unary-fast-closed64", "fast", False, "closed", concurrency=64, duration=6),
        Scenario("unary-fast-closed256", "fast", False, "closed", concurrency=256, duration=6),
        Scenario("stream-fast-closed64", "fast", True, "closed", concurrency=64, duration=6),
        Scenario(
            "stream-burst-closed256",
            "burst",
            True,
            "closed",
            concurrency=256,
            duration=6,
            drain=40.0,
            about="256 streams open at once: RSS and errors",
        ),
        Scenario(
            "token-in-fake-closed1",
            "fake",
            False,
            "closed",
            concurrency=1,
            duration=8,
            about="token-in beside the plain captured call: replayed sessions, one call at a time",
        ),
        Scenario(
            "token-in-stream-fake-closed1",
            "fake",
            True,
            "closed",
            concurrency=1,
            duration=8,
            about="the same, streamed (derender in coalesced calls)",
        ),
        Scenario("token-in-fake-closed4", "fake", False, "closed", concurrency=4, duration=8),
    ]


class Proc:
    """A server process that says ``listening on http://HOST:PORT`` (on stdout or stderr: both
    go to its log file)."""

    def __init__(self, name: str, argv: list[str], logdir: Path, cwd: Path | None = None) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        self._out = open(self.log, "wb")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, cwd=cwd)
        self.url = self._wait_url(60.0)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(rb"listening on (http://\S+)", self.log.read_bytes())
            if m:
                return m.group(1).decode()
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not start:\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._out.close()


def proxy_argv(target: str, upstream: str, store: Path, base: Path | None) -> list[str]:
    """``capture-proxy serve`` for `target`: ``sqlite``/``parquet``, optionally ``-asyncio``
    (``--loop asyncio``), or ``base-`` one of those run by the checkout at `base`; ``token-in``
    is ``sqlite`` with ``--token-in on`` (``base-token-in``: the base checkout's)."""
    if target.removeprefix("base-") == "token-in":
        plain = target.replace("token-in", "sqlite")
        return [*proxy_argv(plain, upstream, store, base), "--token-in", "on"]
    python = PY
    name = target
    if target.startswith("base-"):
        if base is None:
            raise SystemExit(f"target {target} needs --base PATH (another checkout)")
        python = str(base / ".venv" / "bin" / "python")
        name = target.removeprefix("base-")
    store_kind, _, loop = name.partition("-")
    url = f"sqlite:///{store}.db" if store_kind == "sqlite" else f"parquet:///{store}-parquet"
    argv = [python, "-m", "capture_proxy", "serve", "--upstream", upstream, "--store", url]
    argv += ["--port", "0"]
    return [*argv, "--loop", loop] if loop else argv


@contextmanager
def started(
    phase: Phase, targets: list[str], workdir: Path, loop: str, base: Path | None
) -> Iterator[dict[str, Proc | None]]:
    """The upstream for `phase` and every target in front of it; stopped on exit."""
    logs = workdir / f"logs-{phase.name}"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        upstream = Proc(
            "upstream", [PY, str(HERE / phase.upstream), *phase.upstream_args(loop)], logs
        )
        procs.append(upstream)
        out: dict[str, Proc | None] = {}
        for t in targets:
            if t == "direct":
                out[t] = None
                continue
            cwd = None
            if t == "passthrough":
                argv = [PY, str(HERE / "passthrough.py"), "--upstream", upstream.url]
                argv += ["--loop", loop]
            else:
                argv = proxy_argv(t, upstream.url, workdir / f"{phase.name}-{t}-store", base)
                cwd = base if t.startswith("base-") else None
            proc = Proc(t, argv, logs, cwd)
            procs.append(proc)
            out[t] = proc
        out["upstream"] = upstream
        yield out
    finally:
        for p in reversed(procs):
            p.stop()


#: Seconds a run waits for calls still in flight after its last arrival (see loadgen --drain).
DRAIN = {"quick": 5.0, "full": 15.0}


#: The event loop of the benchmark's own processes (upstream, pass-through, load generator).
LOOP = {"loop": "uvloop"}


def run_load(
    url: str, scenario: Scenario, seed: int, tag: str, extra: list[str], drain: float
) -> dict[str, Any]:
    load = PHASES[scenario.phase].load if scenario.phase else "loadgen.py"
    argv = [PY, str(HERE / load), "--url", url, "--seed", str(seed), "--tag", tag]
    argv += ["--loop", LOOP["loop"]]
    argv += [*scenario.load_args(), "--drain", str(drain), *extra]
    limit = scenario.duration + drain + 120
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        out = Path(tmp) / "result.json"
        argv += ["--out", str(out)]
        done = subprocess.run(argv, capture_output=True, timeout=limit, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"load generator failed: {done.stderr.decode()[-2000:]}")
        result: dict[str, Any] = orjson.loads(out.read_bytes())
    return result


def warm_up(url: str, tag: str, phase: Phase) -> None:
    """A few calls first: the proxy fetches /version and /tokenize on first use."""
    if phase.load == "session_load.py":  # sessions: one of them (its calls, one at a time)
        s = Scenario("warmup", phase.name, False, "closed", concurrency=1, duration=0.1)
        run_load(url, s, 0, tag, [], drain=30.0)
        return
    s = Scenario("warmup", "", False, "closed", concurrency=4, duration=30)
    run_load(url, s, 0, tag, ["--count", "8"], drain=30.0)


def measure(
    target: str, proc: Proc | None, url: str, scenario: Scenario, rep: int, drain: float
) -> dict[str, Any]:
    tag = f"{scenario.name}-{rep}-{target}"
    pid = proc.pid if proc is not None else None
    if pid is not None:
        reset_peak_rss(pid)
        cpu0 = cpu_seconds(pid)
    load = run_load(url, scenario, 1000 + rep, tag, [], scenario.drain or drain)
    run: dict[str, Any] = {
        "target": target,
        "scenario": scenario.name,
        "repeat": rep,
        "ok": load["ok"],
        "errors": load["errors"],
        "error_samples": load["error_samples"],
        "elapsed": load["elapsed"],
        "latencies": load["latencies"],
        "ttfbs": load["ttfbs"],
    }
    if pid is not None:
        run["cpu_s"] = cpu_seconds(pid) - cpu0
        run["peak_rss_mb"] = peak_rss_mb(pid)
    return run


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the CI run: under 2 minutes")
    p.add_argument("--repeats", type=int, default=0, help="runs per target (default 3; quick 1)")
    p.add_argument("--scenarios", default="", help="comma-separated subset")
    p.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated, of {', '.join(TARGETS + VARIANTS)}",
    )
    p.add_argument("--json", type=Path, help="write every run's figures here")
    p.add_argument("--markdown", type=Path, help="write the table here")
    p.add_argument("--plot", type=Path, help="PNG: added latency against concurrency")
    p.add_argument("--workdir", type=Path, help="stores and logs (default: a temporary folder)")
    p.add_argument(
        "--base",
        type=Path,
        help="another checkout (with its .venv) whose proxy the base-sqlite / base-parquet "
        "targets run, for a before/after in one run",
    )
    p.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="event loop of the upstream, the pass-through and the load generator",
    )
    args = p.parse_args(argv)
    LOOP["loop"] = args.loop
    repeats = args.repeats or (1 if args.quick else 3)
    drain = DRAIN["quick" if args.quick else "full"]
    targets = [t for t in args.targets.split(",") if t]
    if "direct" not in targets:
        targets.insert(0, "direct")  # every "added" figure is relative to it
    chosen = scenarios(args.quick)
    if args.scenarios:
        wanted = set(args.scenarios.split(","))
        chosen = [s for s in chosen if s.name in wanted]
    info = machine()
    info["command"] = " ".join(["bench/bench_proxy.py", *(argv or sys.argv[1:])])
    info["repeats"] = repeats
    started_at = time.monotonic()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    runs: list[dict[str, Any]] = []
    try:
        for phase_name in PHASES:
            phase_scenarios = [s for s in chosen if s.phase == phase_name]
            if not phase_scenarios:
                continue
            phase = PHASES[phase_name]
            here = [t for t in targets if t in phase.targets]
            with started(phase, here, workdir, args.loop, args.base) as procs:
                upstream = procs["upstream"]
                assert upstream is not None
                urls = {t: (procs[t] or upstream).url for t in here}
                for t in here:
                    warm_up(urls[t], f"warm-{phase_name}-{t}", phase)
                for scenario in phase_scenarios:
                    for rep in range(repeats):
                        order = here[rep % len(here) :] + here[: rep % len(here)]
                        for t in order:
                            run = measure(t, procs[t], urls[t], scenario, rep, drain)
                            runs.append(run)
                            print(_progress(run), file=sys.stderr, flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    info["elapsed_s"] = round(time.monotonic() - started_at)
    info["loadavg_end"] = os.getloadavg()[0]
    summary = summarize(runs, chosen, targets)
    table = render_markdown(summary, chosen, info)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        args.json.write_bytes(
            orjson.dumps(
                {"machine": info, "summary": summary, "runs": runs}, option=orjson.OPT_INDENT_2
            )
        )
    if args.plot:
        from plot import plot_added_latency

        message = plot_added_latency(summary, args.plot)
        print(message, file=sys.stderr)
    return 0


def _progress(run: dict[str, Any]) -> str:
    lat = sorted(run["latencies"]) or [0.0]
    cpu = run.get("cpu_s")
    per_call = f"{1000 * cpu / run['ok']:.2f} ms/call" if cpu is not None and run["ok"] else "-"
    return (
        f"{run['scenario']:<24} rep {run['repeat']} {run['target']:<11} ok {run['ok']:>5} "
        f"err {run['errors']:>3} p50 {1000 * statistics.median(lat):7.1f} ms  cpu {per_call}"
    )


if __name__ == "__main__":
    sys.exit(main())
