"""Opening a Parquet store of many units, and compaction during a write load.

    .venv/bin/python bench/bench_read_open.py [--units 10000] [--s3-units 300] [--json]

1. A local store of `--units` one-call units (rows shaped as the sink's, small: 64 tokens, one
   512-byte blob each), written directly in the layout (no fsync: building is not measured).
   Timed: a new reader opening it and listing its rollouts (`ParquetSource(...).rollouts()`),
   `live_files` (the Arrow readers' snapshot), a compaction, and the same two opens afterwards.
2. The same on moto's S3 server (a subprocess on 127.0.0.1) with `--s3-units` units: the open
   as the reader did it before this change (markers and small units read one at a time through
   pyarrow: a HEAD, then the body, per file) and as it does now (markers read concurrently,
   small units fetched concurrently through obstore, one GET each), side by side in one run,
   with moto's request counts; then after a compaction. Per-unit costs extrapolate to 10,000.
3. Compaction during a write load, local: a `ParquetSink` staging 8 sessions for
   `--load-seconds`, alone and then with compaction looping beside it (grace 0): calls/s and
   stage latency p50 / p99 of both, as a ratio.

One run on a shared machine: compare within the run, as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bench_object_store as bos
import pyarrow.fs as pafs

from capture_proxy.sinks.parquet import (
    ParquetSink,
    _checkpoint,
    _snapshot,
    _source,
    compact_dataset,
    live_files,
)
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._layout import (
    BLOBS,
    CALLS,
    LEDGER,
    Marker,
    create_dataset,
    new_unit_name,
    table_bytes,
    unit_files,
)
from capture_proxy.sinks.parquet._snapshot import read_markers
from capture_proxy.sinks.parquet._source import ParquetSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.sink_factories import Session

bos.TOKENS = 64
bos.BLOB_BYTES = 512


def build(dfs: DatasetFS, units: int) -> None:
    """`units` one-call units, as the sink lays them out (data files, then the marker)."""
    create_dataset(dfs)
    rows = bos.Rows()
    last = 0
    for _ in range(units):
        calls, blobs = rows.batch(1)
        unit, last = new_unit_name(last)
        data = {CALLS: calls, BLOBS: blobs, LEDGER: bos.ledger_rows(calls)}
        tables = [t for t, r in data.items() if r]
        files = unit_files(unit, tables)
        payload = {files[t]: table_bytes(t, data[t]) for t in tables}
        marker = Marker(
            unit=unit,
            files=files,
            rows={t: len(data[t]) for t in tables},
            size=sum(map(len, payload.values())),
        )
        if dfs.local:
            for rel, body in {**payload, marker.rel: marker.encode()}.items():
                Path(dfs.path(rel)).write_bytes(body)
        else:
            dfs.put_all(payload)
            dfs.put_all({marker.rel: marker.encode()})


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def open_and_list(location: str) -> int:
    return len(ParquetSource(location).rollouts())


@contextmanager
def as_before() -> Iterator[None]:
    """The reader as it was: markers and files read one at a time, through pyarrow only."""
    workers, fetch = _snapshot.READ_WORKERS, _source.fetch_files  # type: ignore[attr-defined]
    markers = _source.read_markers  # type: ignore[attr-defined]
    _snapshot.READ_WORKERS = 1
    _source.fetch_files = lambda dfs, rels, object_url: {}  # type: ignore[attr-defined]
    _source.read_markers = lambda dfs, names, object_url=None: read_markers(dfs, names)  # type: ignore[attr-defined]
    # An open reads its markers through the checkpoint's module (`_checkpoint.load_markers`).
    _checkpoint.read_markers = _source.read_markers  # type: ignore[attr-defined]
    try:
        yield
    finally:
        _snapshot.READ_WORKERS = workers
        _source.fetch_files = fetch  # type: ignore[attr-defined]
        _source.read_markers = markers  # type: ignore[attr-defined]
        _checkpoint.read_markers = markers  # type: ignore[attr-defined]


def local_open(units: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-open-") as tmp:
        ds = os.path.join(tmp, "ds")
        build_s, _ = timed(lambda: build(DatasetFS(ds), units))
        open_s, rollouts = timed(lambda: open_and_list(ds))
        live_s, snap = timed(lambda: live_files(ds))
        compact_s, stats = timed(
            lambda: compact_dataset(ds, target_bytes=256 << 20, grace_s=0, shared_window_s=0)
        )
        open2_s, _ = timed(lambda: open_and_list(ds))
        live2_s, _ = timed(lambda: live_files(ds))
    return {
        "units": units,
        "rollouts": rollouts,
        "build_s": round(build_s, 1),
        "open_s": round(open_s, 2),
        "live_files_s": round(live_s, 2),
        "live_calls_files": len(snap.paths()),
        "compact_s": round(compact_s, 1),
        "units_after_compaction": stats.units_after,
        "open_after_compaction_s": round(open2_s, 3),
        "live_files_after_compaction_s": round(live2_s, 3),
    }


def s3_open(units: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-open-s3-") as tmp:
        moto = bos.Moto(Path(tmp))
        try:
            env = {
                "AWS_ENDPOINT_URL": moto.endpoint,
                "AWS_ACCESS_KEY_ID": bos.KEY,
                "AWS_SECRET_ACCESS_KEY": bos.SECRET,
                "AWS_REGION": bos.REGION,
                "AWS_ALLOW_HTTP": "true",
            }
            os.environ.update(env)
            url = f"s3://{bos.BUCKET}/open"
            dfs = DatasetFS(f"{bos.BUCKET}/open", pafs.FileSystem.from_uri(url)[0])
            build_s, _ = timed(lambda: build(dfs, units))
            out: dict[str, Any] = {"units": units, "build_s": round(build_s, 1)}

            def measure(name: str) -> None:
                before = moto.requests()
                seconds, _ = timed(lambda: open_and_list(url))
                requests = moto.requests() - before
                out[name] = {
                    "open_s": round(seconds, 2),
                    "requests": requests,
                    "ms_per_unit": round(1000 * seconds / units, 2),
                    "extrapolated_10k_s": round(10_000 * seconds / units, 1),
                }

            with as_before():
                measure("before")
            measure("now")
            before = moto.requests()
            live_s, _ = timed(lambda: live_files(url))
            out["live_files"] = {"s": round(live_s, 2), "requests": moto.requests() - before}
            compact_s, stats = timed(
                lambda: compact_dataset(url, target_bytes=256 << 20, grace_s=0, shared_window_s=0)
            )
            out["compact_s"] = round(compact_s, 1)
            out["units_after_compaction"] = stats.units_after
            before = moto.requests()
            seconds, _ = timed(lambda: open_and_list(url))
            out["after_compaction"] = {
                "open_s": round(seconds, 3),
                "requests": moto.requests() - before,
            }
        finally:
            moto.stop()
    return out


async def _stage_load(ds: str, seconds: float, compacting: bool) -> dict[str, Any]:
    sink = ParquetSink(ds)
    stop = threading.Event()
    merges = 0

    def maintain() -> None:
        nonlocal merges
        while not stop.is_set():
            stats = compact_dataset(ds, target_bytes=256 << 20, grace_s=0, shared_window_s=0)
            merges += stats.units_before > stats.units_after
            stop.wait(0.2)

    worker = threading.Thread(target=maintain)
    if compacting:
        worker.start()
    latencies: list[float] = []
    deadline = time.monotonic() + seconds

    async def session(n: int) -> None:
        g = 0
        while time.monotonic() < deadline:
            s = Session(f"{'c' if compacting else 'p'}{n}-{g}")
            for _ in range(8):
                record, given = s.next()
                t = time.perf_counter()
                result = await sink.stage(record, attachments=given)
                latencies.append(time.perf_counter() - t)
                assert result.coords is not None, result
            g += 1

    start = time.perf_counter()
    await asyncio.gather(*(session(n) for n in range(8)))
    elapsed = time.perf_counter() - start
    stop.set()
    if compacting:
        worker.join()
    await sink.close()
    q = statistics.quantiles(latencies, n=100)
    return {
        "calls_per_s": round(len(latencies) / elapsed),
        "p50_ms": round(q[49] * 1000, 1),
        "p99_ms": round(q[98] * 1000, 1),
        "compactions_that_merged": merges,
    }


def load(seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        alone = asyncio.run(_stage_load(os.path.join(tmp, "a"), seconds, False))
        beside = asyncio.run(_stage_load(os.path.join(tmp, "b"), seconds, True))
    return {
        "alone": alone,
        "with_compaction": beside,
        "rate_ratio": round(beside["calls_per_s"] / alone["calls_per_s"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--units", type=int, default=10_000)
    ap.add_argument("--s3-units", type=int, default=300)
    ap.add_argument("--load-seconds", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "load_average": os.getloadavg(),
        "local": local_open(args.units) if args.units else None,
        "s3": s3_open(args.s3_units) if args.s3_units else None,
        "compaction_during_load": load(args.load_seconds) if args.load_seconds else None,
    }
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
