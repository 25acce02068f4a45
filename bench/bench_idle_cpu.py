"""What a proxy costs while nothing comes in: CPU milliseconds a second of each idle proxy.

    .venv/bin/python bench/bench_idle_cpu.py --base /path/to/older/checkout [--seconds 30]

A proxy's timers (the event loop's stall probe, the guards, the weight version's re-read, the
heap trim) wake it whether calls come or not, and each wake-up costs CPU: a cost per second, not
per call, which `bench_proxy.py` sees only as a higher CPU per call at low rates (one call at a
time). This starts the same upstream as `bench_proxy.py`'s 200 ms phase, the SQLite proxy of this
checkout and, with ``--base``, of another checkout (its ``.venv``) beside it, a few calls through
each, then measures every proxy's CPU (all its threads, to the nanosecond) over the same idle
``--seconds``, ``--rounds`` times. Both proxies idle at once, so the machine's load weighs on both
alike; the figures are each round's ms/s and the median ratio to the base.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_proxy import LOOP, PHASES, started, warm_up
from procstat import cpu_seconds_fine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, default=None, help="another checkout with its .venv")
    p.add_argument("--seconds", type=float, default=30.0, help="idle seconds a round")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    targets = ["sqlite", "base-sqlite"] if args.base else ["sqlite"]
    phase = PHASES["200ms"]
    rates: dict[str, list[float]] = {t: [] for t in targets}
    with (
        tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp,
        started(phase, targets, Path(tmp), LOOP["loop"], args.base) as procs,
    ):
        pids: dict[str, int] = {}
        for t in targets:
            proc = procs[t]
            assert proc is not None  # a proxy target, never "direct"
            warm_up(proc.url, f"idle-warm-{t}", phase)
            pids[t] = proc.pid
        time.sleep(2.0)  # the warm-up's writes and timers settle
        for n in range(args.rounds):
            before = {t: cpu_seconds_fine(pid) for t, pid in pids.items()}
            started_at = time.monotonic()
            time.sleep(args.seconds)
            elapsed = time.monotonic() - started_at
            for t, pid in pids.items():
                rates[t].append(1000 * (cpu_seconds_fine(pid) - before[t]) / elapsed)
            row = "  ".join(f"{t} {rates[t][-1]:.2f}" for t in targets)
            print(f"round {n}: CPU ms/s {row}; load {os.getloadavg()[0]:.1f}", flush=True)
    for t in targets:
        print(f"{t}: median {statistics.median(rates[t]):.2f} ms/s over {args.rounds} round(s)")
    if args.base:
        ratios = [a / b for a, b in zip(rates["sqlite"], rates["base-sqlite"], strict=True) if b]
        if ratios:
            print(f"sqlite / base-sqlite: median {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
