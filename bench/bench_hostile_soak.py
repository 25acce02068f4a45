"""Honest sandboxes beside hostile ones: does one sandbox deny service to the others?

    .venv/bin/python bench/bench_hostile_soak.py                     # 2 x 30 s
    .venv/bin/python bench/bench_hostile_soak.py --seconds 60 --honest 32
    taskset -c 1 .venv/bin/python bench/bench_hostile_soak.py --seconds 15 --rounds 3 \
        --proxy-cpus 0 --fake-cpus 1 --py-spy /path/to/py-spy   # a shared machine: take turns, pin
    ... --proxy-arg=--fair-share-inflight=0              # the same code, fair turns off

Starts ``capture-proxy serve --upstream fake`` (SQLite store in a temporary folder, the limits
every deploy file sets: the proxy's defaults) and runs the same honest load twice, side by side in
one run: alone, then beside hostile sandboxes (`--rounds` times, taking turns, so that load from
elsewhere on the machine falls on both alike). Each sandbox comes from its own loopback address
(127.0.1.N honest, 127.0.2.N hostile), as sandboxes behind different NATs would. The honest
sandboxes run in this process, the hostile ones in a process of their own: on one client event
loop the floods' thousands of requests delayed the honest calls on the client's side.

- honest: `--honest` sandboxes, each an agent loop: a call of 1-7 KB of conversation (streamed
  every other time), its answer read, 50 ms of "tool work", the next call;
- hostile (`--hostile`, 8 by default, the kinds in turn): a sender of 62 MiB bodies of empty
  ``messages`` (three at once, again and again), a connection flood (up to 1,500 idle connections
  held open, reopened when closed), and a stream flood (1,000 streamed calls at once in one
  rollout, again when answered).

Reported per phase: the honest calls' count, errors, p50 and p99 latency, the proxy's peak RSS and
its event loop's stalls (``/metrics``: a 50 ms timer's lateness, counted over 50 ms to 1 s);
then the ratio of the honest p99 beside the hostile load to the honest p99 alone (issue 27 asks
for at most 2x), per round and the median of the rounds, and the hostile calls' outcomes.
``--fake-cpus`` runs the fake vLLM in a process of its own (as vLLM runs apart from the proxy):
inside the proxy's process its work counts against the proxy's loop. Loopback only; every loop is
bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from bench_proxy import Proc  # bench/ is a folder of scripts run by path: siblings import flat
from procstat import cpu_seconds, peak_rss_mb, reset_peak_rss

_CHAT = "/r/{rollout}/v1/chat/completions"
#: Seconds between a hostile phase and the next: its calls in flight end, its connections close.
_SETTLE_S = 5.0
_TURN = "Look at the crop, then plot the histogram of the red channel, and compare. " * 8


def _honest_body(turn: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(turn % 6):
        messages += [
            {"role": "user", "content": _TURN},
            {"role": "assistant", "content": f"ok {i}"},
        ]
    messages.append({"role": "user", "content": _TURN})
    return {"model": "policy", "messages": messages, "max_tokens": 16, "stream": turn % 2 == 1}


def _session(address: str) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(local_addr=(address, 0), limit=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))


async def _honest(base: str, n: int, until: float, out: list[float], errors: Counter[str]) -> None:
    async with _session(f"127.0.1.{n + 1}") as http:
        for turn in range(100_000):
            if time.monotonic() > until:
                return
            url = base + _CHAT.format(rollout=f"honest-{n}")
            t = time.monotonic()
            try:
                async with http.post(url, json=_honest_body(turn)) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors[f"http_{resp.status}"] += 1
                        continue
            except (aiohttp.ClientError, TimeoutError) as e:
                errors[type(e).__name__] += 1
                continue
            out.append(time.monotonic() - t)
            await asyncio.sleep(0.05)


async def _huge_arrays(base: str, n: int, until: float, seen: Counter[str]) -> None:
    body = b'{"model":"policy","messages":[' + b"{}," * (62 * 2**20 // 3) + b"{}]}"
    url = base + _CHAT.format(rollout=f"hostile-{n}")
    headers = {"Content-Type": "application/json"}

    async def one(http: aiohttp.ClientSession) -> None:
        try:
            async with http.post(url, data=body, headers=headers) as resp:
                await resp.read()
                seen[f"huge_arrays http_{resp.status}"] += 1
        except (aiohttp.ClientError, TimeoutError) as e:
            seen[f"huge_arrays {type(e).__name__}"] += 1

    async with _session(f"127.0.2.{n + 1}") as http:
        for _ in range(1000):
            if time.monotonic() > until:
                return
            await asyncio.gather(one(http), one(http), one(http))


async def _connection_flood(port: int, n: int, until: float, seen: Counter[str]) -> None:
    held: list[asyncio.StreamWriter] = []
    try:
        for _ in range(100_000):
            if time.monotonic() > until:
                return
            held = [w for w in held if not w.is_closing()]
            if len(held) >= 1500:
                await asyncio.sleep(0.5)
                continue
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(f"127.0.2.{n + 1}", 0)
                )
            except OSError as e:
                seen[f"flood {type(e).__name__}"] += 1
                await asyncio.sleep(0.1)
                continue
            held.append(writer)
            seen["flood opened"] += 1
            with contextlib.suppress(TimeoutError):
                # A refused connection gets its 503 at once; an admitted one says nothing.
                first = await asyncio.wait_for(reader.read(12), 0.005)
                if first.startswith(b"HTTP/1.1 503"):
                    seen["flood refused 503"] += 1
                    writer.close()
                    await asyncio.sleep(0.05)
    finally:
        for w in held:
            w.close()


async def _connection_churn(port: int, n: int, until: float, seen: Counter[str]) -> None:
    """Not in the soak's mix (`bench_hostile_cost.py` runs it alone): 64 loops from one address
    opening a connection, reading what the proxy says until it closes, and again, as fast as
    they can. Past the address's rate nearly every one is refused at accept: the proxy's CPU per
    connection is what such a refusal costs."""

    async def loop() -> None:
        while time.monotonic() < until:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(f"127.0.2.{n + 1}", 0)
                )
            except OSError as e:
                seen[f"churn {type(e).__name__}"] += 1
                continue
            try:
                first = await asyncio.wait_for(reader.read(12), 0.05)  # admitted: silent
                seen[
                    "churn refused 503" if first.startswith(b"HTTP/1.1 503") else "churn other"
                ] += 1
            except (OSError, TimeoutError) as e:
                seen[f"churn {type(e).__name__}"] += 1
            writer.close()

    await asyncio.gather(*(loop() for _ in range(64)))


async def _stream_flood(base: str, n: int, until: float, seen: Counter[str]) -> None:
    url = base + _CHAT.format(rollout=f"hostile-{n}")
    body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "stream": True}

    async def one(http: aiohttp.ClientSession) -> None:
        try:
            async with http.post(url, json=body) as resp:
                await resp.read()
                seen[f"streams http_{resp.status}"] += 1
        except (aiohttp.ClientError, TimeoutError) as e:
            seen[f"streams {type(e).__name__}"] += 1

    async with _session(f"127.0.2.{n + 1}") as http:
        for _ in range(1000):
            if time.monotonic() > until:
                return
            await asyncio.gather(*(one(http) for _ in range(1000)))


#: The hostile kinds, in the order sandbox n takes them (n modulo 3).
KINDS = ("huge_arrays", "connection_flood", "stream_flood")


async def _hostile(
    base: str, hostile: int, seconds: float, only: frozenset[str] = frozenset(KINDS)
) -> dict[str, int]:
    """The hostile sandboxes alone (run in a process of their own: `_phase`); those of a kind
    not in `only` stay idle, so one kind can be run with the counts of the full mix."""
    port = int(base.rsplit(":", 1)[1])
    until = time.monotonic() + seconds
    seen: Counter[str] = Counter()
    kinds = {
        "huge_arrays": lambda n: _huge_arrays(base, n, until, seen),
        "connection_flood": lambda n: _connection_flood(port, n, until, seen),
        "stream_flood": lambda n: _stream_flood(base, n, until, seen),
        "connection_churn": lambda n: _connection_churn(port, n, until, seen),
    }
    mine = [n for n in range(hostile) if KINDS[n % len(KINDS)] in only]
    runs = [kinds[KINDS[n % len(KINDS)]](n) for n in mine]
    if "connection_churn" in only:
        runs.append(kinds["connection_churn"](hostile))
    # Cut at the phase's end: a stream left waiting (60 s client timeout) would otherwise keep
    # the worker, and the run, going long after the honest phase ended.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds + 1):
            await asyncio.gather(*runs)
    return dict(seen)


async def _loop_stalls(base: str) -> dict[str, float]:
    """The proxy's event-loop stall counters and worst lag since start, and its fair turns'
    counters (`/metrics`)."""
    async with (
        _session("127.0.3.1") as http,
        http.get(base + "/metrics") as resp,
    ):
        text = await resp.text()
    return {
        name.removeprefix("capture_proxy_event_loop_").removeprefix("capture_proxy_"): float(value)
        for name, _, value in (line.partition(" ") for line in text.splitlines())
        if name.startswith(("capture_proxy_event_loop_", "capture_proxy_fair_share_"))
    }


async def _phase(
    base: str, pid: int, honest: int, hostile: int, seconds: float, nice: int = 0
) -> dict[str, Any]:
    """The honest sandboxes in this process, the hostile ones in another: sharing one client
    event loop, the floods' thousands of requests delayed the honest calls on the client side,
    and that delay was counted as the proxy's."""
    reset_peak_rss(pid)
    stalls_before = await _loop_stalls(base)
    cpu_before = cpu_seconds(pid)
    until = time.monotonic() + seconds
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    worker = None
    if hostile:
        argv = [sys.executable, __file__, "--hostile-worker", base]
        if nice:
            argv = ["nice", "-n", str(nice), *argv]
        argv += ["--hostile", str(hostile), "--seconds", str(seconds)]
        worker = subprocess.Popen(argv, stdout=subprocess.PIPE)  # noqa: ASYNC220 (started once)
    await asyncio.gather(*(_honest(base, n, until, latencies, errors) for n in range(honest)))
    seen: dict[str, int] = {}
    if worker is not None:
        out, _ = worker.communicate(timeout=120)
        seen = orjson.loads(out.splitlines()[-1]) if out.strip() else {"worker failed": 1}
    # The proxy's own CPU time in the phase: unlike latency, not inflated by other processes
    # waiting for the same core (on a loaded machine the latencies mostly measure that).
    cpu_s = cpu_seconds(pid) - cpu_before
    stalls_after = await _loop_stalls(base)
    # Stalls of the proxy's loop in this phase (a 50 ms timer's lateness, server/loop_lag.py).
    stalls = {
        k.removesuffix("_total"): int(v - stalls_before.get(k, 0))
        for k, v in stalls_after.items()
        if k.startswith(("stalls_over_", "fair_share_w", "fair_share_r"))
    }
    return {
        **_summary(hostile, latencies, dict(errors), peak_rss_mb(pid)),
        "proxy_cpu_s": round(cpu_s, 2),
        "proxy_cpu_ms_per_honest_call": round(1000 * cpu_s / max(1, len(latencies)), 2),
        "loop_stalls": stalls,
        "loop_lag_max_since_start_s": stalls_after.get("lag_max_seconds"),
        "hostile_outcomes": seen,
        "latencies": latencies,
    }


def _summary(
    hostile: int, latencies: list[float], errors: dict[str, int], peak_mb: float
) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "hostile": hostile,
        "honest_calls": len(ordered),
        "honest_errors": errors,
        "p50_ms": round(1000 * statistics.median(ordered), 1) if ordered else None,
        "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1) if ordered else None,
        "peak_rss_mb": round(peak_mb),
    }


def _py_spy(path: str, pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy recording the proxy's threads for the phase."""
    if not path:
        return None
    argv = [path, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200"]
    argv += ["--format", "raw", "--output", str(out), "--nonblocking"]
    argv += ["--threads"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _print_profile(folded: Path, seconds: float, top: int = 25) -> None:
    """How busy each thread was, and the main thread's (the event loop's) functions by share."""
    samples: Counter[str] = Counter()
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples[stack] += int(count)
    threads: Counter[str] = Counter()
    for stack, n in samples.items():
        threads[stack.split(";", 1)[0]] += n
    for thread, n in threads.most_common(6):
        print(f"{thread}: busy {100 * n / (200 * seconds):.0f}% of the phase")
    main_thread = threads.most_common(1)[0][0] if threads else ""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, n in samples.items():
        frames = stack.split(";")
        if frames[0] != main_thread:
            continue
        names = [f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") for f in frames[1:]]
        for name in set(names):
            inclusive[name] += n
        if names:
            own[names[-1]] += n
    total = threads[main_thread] or 1
    print(f"the busiest thread's functions, share of its busy samples ({total}):")
    for name, n in inclusive.most_common(top):
        print(f"  {100 * n / total:5.1f}% incl {100 * own[name] / total:5.1f}% self  {name}")


def _start_fake(cpus: str, logdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    argv = [sys.executable, "-m", "capture_proxy.fake_vllm", "--port", "0", "--model", "policy"]
    if cpus != "-":
        argv = ["taskset", "-c", cpus, *argv]
    log = logdir / "fake.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    for _ in range(600):
        found = re.search(rb"Running on (http://\S+)", log.read_bytes())
        if found:
            return popen, found.group(1).decode()
        time.sleep(0.05)
    popen.kill()
    raise RuntimeError(f"the fake vLLM did not start:\n{log.read_text()[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument(
        "--rounds", type=int, default=1, help="alone and beside the hostile load, taking turns"
    )
    parser.add_argument("--honest", type=int, default=32)
    parser.add_argument("--hostile", type=int, default=8)
    parser.add_argument("--proxy-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument(
        "--proxy-cpus",
        default="",
        help="pin the proxy to these CPUs (taskset -c); pin this script itself with taskset",
    )
    parser.add_argument(
        "--py-spy",
        default="",
        help="path of py-spy: record the proxy's threads in each phase to "
        "hostile-soak-<hostile sandboxes>.folded (busy samples only: their count over 200 a "
        "second is how busy a thread was) and print the busiest thread's top functions",
    )
    parser.add_argument(
        "--fake-cpus",
        default="",
        help="run the fake vLLM as a process of its own pinned to these CPUs (as vLLM runs "
        "apart from the proxy) instead of inside the proxy's process ('-': apart, unpinned)",
    )
    parser.add_argument(
        "--hostile-nice",
        type=int,
        default=0,
        help="run the hostile sandboxes' process at this nice value (e.g. 19): on a machine this "
        "small it shares a core with the honest load generator, whose own delays would count as "
        "the proxy's; in a deployment sandboxes run on other machines",
    )
    parser.add_argument("--hostile-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--kinds", default=",".join(KINDS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hostile_worker:
        only = frozenset(args.kinds.split(","))
        seen = asyncio.run(_hostile(args.hostile_worker, args.hostile, args.seconds, only))
        print(orjson.dumps(seen).decode(), flush=True)
        return
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-hostile-soak-") as tmp:
        fake = _start_fake(args.fake_cpus, Path(tmp)) if args.fake_cpus else None
        upstream = fake[1] if fake else "fake"
        argv = [sys.executable, "-m", "capture_proxy", "serve", "--upstream", upstream]
        if args.proxy_cpus:
            argv = ["taskset", "-c", args.proxy_cpus, *argv]
        argv += ["--store", f"sqlite:///{tmp}/capture.db", "--port", "0"]
        argv += ["--min-free-disk-mb", "64", "--log-level", "warning", *args.proxy_arg]
        proxy = Proc("proxy", argv, Path(tmp))
        try:
            rows = []
            for n in range(args.rounds):
                for hostile in (0, args.hostile):
                    folded = Path(f"hostile-soak-{hostile}.folded")
                    spy = _py_spy(args.py_spy, proxy.pid, args.seconds, folded) if not n else None
                    row = asyncio.run(
                        _phase(
                            proxy.url,
                            proxy.pid,
                            args.honest,
                            hostile,
                            args.seconds,
                            args.hostile_nice,
                        )
                    )
                    if spy is not None:
                        spy.wait(30)
                        _print_profile(folded, args.seconds)
                    rows.append(row)
                    shown = {k: v for k, v in row.items() if k != "latencies"}
                    print(orjson.dumps({"round": n, **shown}).decode(), flush=True)
                    if proxy.popen.poll() is not None:
                        raise SystemExit(f"the proxy exited with {proxy.popen.returncode}")
                    if hostile:
                        time.sleep(_SETTLE_S)  # what the hostile phase left in flight ends
        finally:
            proxy.stop()
            if fake is not None:
                fake[0].terminate()
                fake[0].wait(20)
    # The rounds together: alone and beside take turns, so load from elsewhere on the machine
    # falls on both alike.
    print()
    print("| phase | honest calls | honest errors | p50 ms | p99 ms | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    both = []
    for hostile in (0, args.hostile):
        mine = [r for r in rows if r["hostile"] == hostile]
        errors: Counter[str] = Counter()
        for r in mine:
            errors.update(r["honest_errors"])
        latencies = [x for r in mine for x in r["latencies"]]
        peak = max(r["peak_rss_mb"] for r in mine)
        t = _summary(hostile, latencies, dict(errors), peak)
        both.append(t)
        phase = "honest alone" if not hostile else f"beside {hostile} hostile"
        print(
            f"| {phase} | {t['honest_calls']} | {sum(errors.values())} | {t['p50_ms']} | "
            f"{t['p99_ms']} | {t['peak_rss_mb']} |"
        )
    hostile_seen: Counter[str] = Counter()
    for r in rows:
        hostile_seen.update(r["hostile_outcomes"])
    print(f"\nhostile outcomes, all rounds: {dict(sorted(hostile_seen.items()))}")
    alone, beside = both
    if alone["p99_ms"] and beside["p99_ms"]:
        print(
            "\nhonest p99 beside / alone, all rounds pooled: "
            f"{beside['p99_ms'] / alone['p99_ms']:.2f}x"
        )
    # Each round's own ratio (its alone phase ran just before its hostile one), and their median:
    # the machine's other load moves from round to round, and falls on both phases of a round.
    ratios = []
    for n in range(args.rounds):
        a, b = rows[2 * n], rows[2 * n + 1]
        if a["p99_ms"] and b["p99_ms"]:
            ratios.append(b["p99_ms"] / a["p99_ms"])
            print(
                f"round {n}: alone p99 {a['p99_ms']} ms, beside {b['p99_ms']} ms: "
                f"{ratios[-1]:.2f}x; proxy CPU {a['proxy_cpu_s']} s / {b['proxy_cpu_s']} s, "
                f"honest calls {a['honest_calls']} / {b['honest_calls']}; "
                f"loop stalls beside: {b['loop_stalls']}"
            )
    if ratios:
        print(f"median of the rounds' ratios: {statistics.median(ratios):.2f}x")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
