"""The Parquet sink's writer under the proxy's write pattern, in-process (no HTTP).

    .venv/bin/python bench/parquet_writer.py [--rate 100] [--seconds 6] [--sessions 32]
                                             [--sinks parquet,sqlite] [--json]

Each call does what a proxied call asks of its sink: its admission claim (a ``claim`` event)
is submitted at arrival, the call "waits for the upstream" (`--upstream-ms`, 200), then its
claim is awaited and its record staged. Arrivals are Poisson at `--rate` calls/s over agent
sessions (turn after turn, each record's parent the session's previous call). Records are
built and sealed before the clock starts. Reported per sink: calls/s staged, the p50/p99 of a
call's time from the end of its upstream wait to its record's `staged`, the claim's wait, the
process's CPU per call, and the writer's batches. A writer slower than the arrivals shows as a
growing p99 (the proxy would answer 503 ``staging_backlog`` once 256 records wait).

Run it from two checkouts (each with its own venv) to compare them, interleaved: the machine is
shared, so compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench_staging import Session

from capture_proxy.schemas.events import claim_event
from capture_proxy.schemas.records import CallStatus, StagedCallRecord
from capture_proxy.sinks.base import StagingSink


def _sink(kind: str, where: Path) -> StagingSink:
    if kind == "sqlite":
        from capture_proxy.sinks.sqlite import SQLiteSink

        return SQLiteSink(str(where / "store.db"))
    from capture_proxy.sinks.parquet import ParquetSink

    return ParquetSink(str(where / "store-parquet"))


def _records(sessions: int, calls: int) -> list[StagedCallRecord]:
    """`calls` records, turn after turn of `sessions` interleaved sessions."""
    live = [Session(f"s{i}", seed=i) for i in range(sessions)]
    return [live[i % sessions].next() for i in range(calls)]


async def _run(
    kind: str, where: Path, records: list[StagedCallRecord], args: Any
) -> dict[str, Any]:
    sink = _sink(kind, where)
    rng = random.Random(1)
    loop = asyncio.get_running_loop()
    waits: list[float] = []
    claim_waits: list[float] = []
    failed = 0

    async def call(record: StagedCallRecord) -> None:
        nonlocal failed
        claim = asyncio.ensure_future(
            sink.append_event(
                claim_event(record.rollout_id, record.seq, record.call_id, record.created_at_ms)
            )
        )
        await asyncio.sleep(args.upstream_ms / 1000)
        t0 = loop.time()
        await claim
        claim_waits.append(loop.time() - t0)
        result = await sink.stage(record)
        waits.append(loop.time() - t0)
        if result.status is not CallStatus.STAGED:
            failed += 1

    # Warm up: the first commit imports and sets up what later ones reuse (pyarrow's writers).
    warm = Session("warm-up", seed=-1).next()
    await sink.append_event(claim_event(warm.rollout_id, 0, warm.call_id, warm.created_at_ms))
    await sink.stage(warm)
    cpu0 = os.times()
    start = loop.time()
    tasks: list[asyncio.Task[None]] = []
    t = 0.0
    for record in records:
        t += rng.expovariate(args.rate)
        delay = start + t - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(call(record)))
    await asyncio.gather(*tasks)
    elapsed = loop.time() - start
    cpu1 = os.times()
    stats = sink.stats() if hasattr(sink, "stats") else {}
    await sink.close()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    waits.sort()
    return {
        "sink": kind,
        "calls": len(records),
        "failed": failed,
        "calls_per_s": len(records) / elapsed,
        "p50_ms": statistics.median(waits) * 1000,
        "p99_ms": waits[int(len(waits) * 0.99) - 1] * 1000,
        "claim_wait_p50_ms": statistics.median(claim_waits) * 1000,
        "cpu_ms_per_call": cpu * 1000 / len(records),
        "sys_ms_per_call": (cpu1.system - cpu0.system) * 1000 / len(records),
        "batches": stats.get("batches_total"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="arrivals, calls/s (Poisson)")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--upstream-ms", type=float, default=200.0)
    p.add_argument("--sinks", default="parquet")
    p.add_argument("--dir", help="where the stores go (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = p.parse_args()
    calls = int(args.rate * args.seconds)
    records = _records(args.sessions, calls)
    out = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for kind in args.sinks.split(","):
            where = Path(tmp) / kind
            where.mkdir()
            figures = asyncio.run(_run(kind, where, records, args))
            out.append(figures)
            print(
                f"{kind:8} {figures['calls_per_s']:6.1f} calls/s  staged p50 "
                f"{figures['p50_ms']:7.1f} ms p99 {figures['p99_ms']:7.1f} ms  claim wait p50 "
                f"{figures['claim_wait_p50_ms']:6.1f} ms  cpu {figures['cpu_ms_per_call']:5.2f} "
                f"ms/call (sys {figures['sys_ms_per_call']:5.2f})  batches {figures['batches']}  "
                f"failed {figures['failed']}",
                flush=True,
            )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
