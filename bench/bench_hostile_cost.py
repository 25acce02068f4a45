"""What each hostile kind of `bench_hostile_soak.py` costs the proxy's CPU, with no honest load.

    taskset -c 1 .venv/bin/python bench/bench_hostile_cost.py --proxy-cpus 0 --fake-cpus 1
    taskset -c 1 .venv/bin/python bench/bench_hostile_cost.py --proxy-cpus 0 --fake-cpus 1 \\
        --base /work/wt/hostile-base            # another checkout (its own .venv) side by side

Starts the fake vLLM (a process of its own) and one proxy per target (this checkout, and with
``--base`` the other checkout's, each pinned to ``--proxy-cpus``), then runs the soak's hostile
sandboxes (`bench_hostile_soak._hostile`, the same 8 with the same counts per kind) one kind at
a time, then all together, against each target in turn (``--rounds`` times, so load from
elsewhere on the machine falls on every target alike). ``connection_churn`` (not in the soak's
mix) is 64 loops from one address opening connections as fast as they can: the cost of a
refusal at accept. Per phase: the proxy's CPU seconds (``/proc``: its own time on a CPU, not
inflated by waiting for it) over the load's seconds and two more (the worker's cut, its last
answers), given per 10 s of load; and what the proxy did in the phase, from its ``/metrics``:
connections refused at accept, chat requests answered per status. Then CPU milliseconds per
refused connection, per 429 and per huge body (413/422 of the huge-array sender), each from the
phase that ran that kind alone (the phase's whole CPU over that count). Loopback only; each
phase is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import orjson
from bench_hostile_soak import KINDS, _print_profile, _py_spy, _start_fake
from bench_proxy import Proc
from procstat import cpu_seconds

HERE = Path(__file__).resolve().parent
#: Seconds after a phase before the next: lingering connections close, streams end.
_SETTLE_S = 3.0
#: Seconds of a phase's CPU window after its load: the worker's cut, then its last answers.
_TAIL_S = 2.0
#: A counter line of ``/metrics`` (a route's label holds braces: ``/r/{rollout_id}/...``).
_METRIC = re.compile(
    r"^capture_proxy_(requests_total|client_connections_\w+_total)(\{.*\})? (\S+)$"
)


async def _metrics(url: str) -> Counter[str]:
    connector = aiohttp.TCPConnector(local_addr=("127.0.3.1", 0))
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.get(url + "/metrics") as resp,
    ):
        text = await resp.text()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name == "requests_total":
            route = re.search(r'route="([^"]*)"', labels or "")
            status = re.search(r'status="([^"]*)"', labels or "")
            if route and status and "chat" in route.group(1):
                out[f"chat {status.group(1)}"] += int(float(value))
        else:
            out[name.removeprefix("client_connections_").removesuffix("_total")] = int(float(value))
    return out


def _phase(
    url: str, pid: int, kinds: str, seconds: float, hostile: int, py_spy: str = ""
) -> dict[str, object]:
    before = asyncio.run(_metrics(url))
    folded = Path(f"hostile-cost-{kinds.replace(',', '+')}.folded")
    spy = _py_spy(py_spy, pid, seconds, folded)
    cpu0 = cpu_seconds(pid)
    t0 = time.monotonic()
    argv = [sys.executable, str(HERE / "bench_hostile_soak.py"), "--hostile-worker", url]
    argv += ["--hostile", str(hostile), "--seconds", str(seconds), "--kinds", kinds]
    worker = subprocess.Popen(argv, stdout=subprocess.PIPE)
    # The same window for every target: the load's `seconds` and the worker's cut a second
    # after (`_hostile`), plus a second for what the last refusals and answers cost. Read at
    # the worker's exit instead, a target whose clients took longer to wind down would have
    # its CPU spread over a longer phase.
    time.sleep(max(0.0, t0 + seconds + _TAIL_S - time.monotonic()))
    cpu = cpu_seconds(pid) - cpu0
    out, _ = worker.communicate(timeout=120)
    if spy is not None:
        spy.wait(30)
        _print_profile(folded, seconds, top=40)
    after = asyncio.run(_metrics(url))
    did = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
    seen = orjson.loads(out.splitlines()[-1]) if out.strip() else {"worker failed": 1}
    time.sleep(_SETTLE_S)
    return {"cpu_s": cpu, "load_s": seconds, "proxy": did, "client": seen}


def _units(kind: str, did: dict[str, int]) -> tuple[str, int]:
    """What one phase of `kind` alone is counted in, and how many the proxy handled."""
    if kind in ("connection_flood", "connection_churn"):
        return "refused connection", did.get("refused", 0)
    if kind == "huge_arrays":
        return "huge body", sum(v for k, v in did.items() if k.startswith("chat 4"))
    return "429", did.get("chat 429", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hostile", type=int, default=8)
    parser.add_argument("--base", default="", help="another checkout to run side by side")
    parser.add_argument("--proxy-cpus", default="", help="pin the proxies (taskset -c)")
    parser.add_argument("--fake-cpus", default="-", help="pin the fake vLLM ('-': unpinned)")
    parser.add_argument(
        "--kinds",
        default=",".join([*KINDS, "all"]),
        help="phases: hostile kinds run alone, and 'all' for the soak's mix",
    )
    parser.add_argument("--proxy-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument(
        "--py-spy",
        default="",
        help="path of py-spy: record this checkout's proxy in each phase of the first round to "
        "hostile-cost-<kinds>.folded and print its busiest thread's top functions",
    )
    args = parser.parse_args()
    targets = {"this": sys.executable}
    if args.base:
        targets["base"] = str(Path(args.base) / ".venv" / "bin" / "python")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="bench-hostile-cost-") as tmp:
        fake, upstream = _start_fake(args.fake_cpus, Path(tmp))
        procs: dict[str, Proc] = {}
        try:
            for name, python in targets.items():
                argv = [python, "-m", "capture_proxy", "serve", "--upstream", upstream]
                if args.proxy_cpus:
                    argv = ["taskset", "-c", args.proxy_cpus, *argv]
                argv += ["--store", f"sqlite:///{tmp}/{name}.db", "--port", "0"]
                argv += ["--min-free-disk-mb", "64", "--log-level", "warning", *args.proxy_arg]
                procs[name] = Proc(f"proxy-{name}", argv, Path(tmp))
            for n in range(args.rounds):
                for kind in args.kinds.split(","):
                    kinds = ",".join(KINDS) if kind == "all" else kind
                    for name, proc in procs.items():
                        spy = args.py_spy if name == "this" and not n else ""
                        row = _phase(proc.url, proc.pid, kinds, args.seconds, args.hostile, spy)
                        row |= {"round": n, "kind": kind, "target": name}
                        rows.append(row)
                        print(orjson.dumps(row).decode(), flush=True)
        finally:
            for proc in procs.values():
                proc.stop()
            fake.terminate()
            fake.wait(20)
    print()
    print("| kind | target | proxy CPU s per 10 s | per unit | CPU ms per unit |")
    print("|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for name in targets:
            mine = [r for r in rows if r["kind"] == kind and r["target"] == name]
            per10 = [10 * float(r["cpu_s"]) / float(r["load_s"]) for r in mine]  # type: ignore[arg-type]
            cell = f"{statistics.median(per10):.2f}" + (
                f" ({min(per10):.2f}-{max(per10):.2f})" if len(per10) > 1 else ""
            )
            unit, ms = "-", "-"
            if kind != "all":
                counts = [_units(kind, r["proxy"]) for r in mine]  # type: ignore[arg-type]
                unit = f"{counts[0][0]}: {statistics.median([c for _, c in counts]):.0f}"
                per = [
                    1000 * float(r["cpu_s"]) / c  # type: ignore[arg-type]
                    for r, (_, c) in zip(mine, counts, strict=True)
                    if c
                ]
                ms = f"{statistics.median(per):.3f}" if per else "-"
            print(f"| {kind} | {name} | {cell} | {unit} | {ms} |")


if __name__ == "__main__":
    main()
