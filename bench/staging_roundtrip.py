"""Where the time of one sequential staging write goes, SQLite store.

    .venv/bin/python bench/staging_roundtrip.py [--turns 60] [--gap 0.02] [--dir DIR]

Stages one agent session turn after turn through the proxy's `Stager` and `SQLiteSink`, one
write at a time with `gap` seconds of an idle event loop between writes (as between the calls of
one agent), and splits each round trip at the points the writer thread passes:

- ``hand-off in``: from `Stager.stage` being called to the writer thread starting the batch
  (the stager's bookkeeping, the queue, the thread waking up);
- ``insert``: the record's work on the writer thread (encoding, blob lookups, the INSERTs);
- ``commit``: from the end of that work to the thread handing the result back (``COMMIT``,
  whose ``fdatasync`` is the durability, and the file identity check);
- ``hand-off back``: from there to `Stager.stage` returning on the event loop (waking the loop,
  settling the future, resuming the caller).

It also times a bare ``fdatasync`` of a small append on the same disk: the floor of ``commit``.
``--busy 0.5`` keeps the event loop busy half the time meanwhile (Python work in 1 ms slices, as
other calls' decoding would), which shows what waiting for the GIL adds to the writer thread.
Records are built and sealed before the clock starts. Prints medians and p90s in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_staging import Session
from report import pct

from capture_proxy.core.staging import Stager
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.sqlite import SQLiteSink

STEPS = ("hand-off in", "insert", "commit", "hand-off back", "total")


def _fdatasync_ms(folder: Path, rounds: int) -> list[float]:
    path = folder / "fsync-probe"
    out = []
    with open(path, "ab") as fh:
        for _ in range(rounds):
            fh.write(b"x" * 4096)
            fh.flush()
            t = time.perf_counter()
            os.fdatasync(fh.fileno())
            out.append(1000 * (time.perf_counter() - t))
    path.unlink()
    return out


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))  # Python bytecode: holds the GIL as the proxy's own work does


async def _busy(share: float) -> None:
    """Keep the event loop busy `share` of the time, in 1 ms slices of Python work (other calls'
    decoding and building, at a given load)."""
    while True:
        _spin(0.001)
        await asyncio.sleep(0.001 * (1 - share) / share)


async def _run(
    folder: Path, turns: int, gap: float, busy: float, autocheckpoint: int | None
) -> dict[str, list[float]]:
    session = Session("rt", 7)
    records = [session.next() for _ in range(turns)]
    sink = SQLiteSink(str(folder / "rt.db"))
    stager = Stager(sink, timeout=10.0, max_pending=256)
    marks: dict[str, float] = {}
    writer: Any = sink._writer  # the bench reads the writer's steps; nothing else is changed
    if autocheckpoint is not None:  # before the first write: the writer thread is idle
        writer._conn.execute(f"PRAGMA wal_autocheckpoint = {int(autocheckpoint)}")

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            marks[f"{name}<"] = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                marks[f"{name}>"] = time.perf_counter()

        return wrapper

    writer._commit = timed("commit", writer._commit)
    writer._deliver = timed("deliver", writer._deliver)
    sink._stage_one = timed("work", sink._stage_one)  # type: ignore[method-assign]
    steps: dict[str, list[float]] = {s: [] for s in STEPS}
    load = asyncio.ensure_future(_busy(busy)) if busy > 0 else None
    try:
        for i, record in enumerate(records):
            await asyncio.sleep(gap)
            marks.clear()
            t0 = time.perf_counter()
            result = await stager.stage(record, {})
            t1 = time.perf_counter()
            if result.status is not CallStatus.STAGED:
                raise RuntimeError(f"{record.call_id} was not staged: {result}")
            if i < 3:  # warm-up: first opens, caches
                continue
            for name, a, b in (
                ("hand-off in", t0, marks["commit<"]),
                ("insert", marks["work<"], marks["work>"]),
                ("commit", marks["work>"], marks["deliver<"]),
                ("hand-off back", marks["deliver<"], t1),
                ("total", t0, t1),
            ):
                steps[name].append(1000 * (b - a))
    finally:
        if load is not None:
            load.cancel()
        await sink.close()
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=60)
    p.add_argument("--gap", type=float, default=0.02, help="idle seconds between writes")
    p.add_argument(
        "--busy",
        type=float,
        default=0.0,
        help="share of the time the event loop is kept busy meanwhile (0-0.9)",
    )
    p.add_argument(
        "--wal-autocheckpoint",
        type=int,
        help="SQLite's wal_autocheckpoint for the run, in pages (0: none; default: the store's)",
    )
    p.add_argument("--json", action="store_true", help="print the medians as one JSON line")
    p.add_argument("--dir", type=Path, help="where the store goes (default: a temporary folder)")
    p.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="event loop (asyncio: runs against checkouts from before --loop too)",
    )
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="rt-", dir=args.dir))
    try:
        sync = _fdatasync_ms(folder, 40)
        work = _run(folder, args.turns, args.gap, args.busy, args.wal_autocheckpoint)
        if args.loop == "asyncio":
            steps = asyncio.run(work)
        else:
            from capture_proxy.server.event_loop import run

            steps = run(work, args.loop)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        figures = {k: statistics.median(v) for k, v in steps.items()}
        figures.update({f"{k} p90": pct(v, 90) for k, v in steps.items()})
        figures["commit max"] = max(steps["commit"])
        print(json.dumps({**figures, "fdatasync": statistics.median(sync)}))
        return
    print(f"{'step':<14} {'p50 ms':>7} {'p90 ms':>7}")
    for name in STEPS:
        v = steps[name]
        print(f"{name:<14} {statistics.median(v):7.3f} {pct(v, 90):7.3f}")
    print(f"{'fdatasync':<14} {statistics.median(sync):7.3f} {pct(sync, 90):7.3f}")


if __name__ == "__main__":
    main()
