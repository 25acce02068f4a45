"""Where a proxy's Parquet writer spends its time on object storage: opening a store of a few
hundred units, and its reader's refreshes when other writers and a compaction change the units.

    .venv/bin/python bench/bench_resume.py [--units 300] [--json]

On moto's S3 server (a subprocess on 127.0.0.1), a store of `--units` one-call units (each
with a ``staged`` event in its ledger file). Timed, with moto's request counts:

1. open: a `ParquetSink` opening the store (what a restarted proxy does before its first call);
2. interleaved: the writer's reader refreshing after another writer's unit lands with an order
   below the last listed one (three proxies committing at once do this all the time);
3. compaction: the reader refreshing after a compaction merged every unit, its retired markers
   still listed (their grace period);
4. resume: after `--units` / 10 more units, another compaction and another out-of-order unit,
   reading one rollout's event log, as a writer resuming the rollout does (with the refresh it
   waits for).

One run on a shared machine: request counts are what to compare between versions.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_object_store as bos
import pyarrow.fs as pafs

from capture_proxy.sinks.parquet import ParquetSink, compact_dataset
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._layout import (
    BLOBS,
    CALLS,
    LEDGER,
    Marker,
    create_dataset,
    list_markers,
    table_bytes,
    unit_files,
)

bos.TOKENS = 64
bos.BLOB_BYTES = 512


def ledger(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A header for each rollout's first call, and each call's ``staged`` event."""
    events = [
        {"kind": "event", "rollout_id": c["rollout_id"], "call_id": c["call_id"]}
        | {"event_kind": "staged", "position": c["seq"], "hash": f"{c['seq']:064x}"}
        | {"prev_hash": "", "body": b"{}", "at_ms": 0}
        for c in calls
    ]
    return bos.ledger_rows(calls) + events


def add_unit(dfs: DatasetFS, rows: bos.Rows, order: int) -> None:
    """One one-call unit with `order`, as the sink lays it out (data files, then the marker)."""
    calls, blobs = rows.batch(1)
    unit = f"{order:020d}-{os.urandom(6).hex()}"
    data = {CALLS: calls, BLOBS: blobs, LEDGER: ledger(calls)}
    files = unit_files(unit, data)
    payload = {files[t]: table_bytes(t, r) for t, r in data.items()}
    size = sum(map(len, payload.values()))
    marker = Marker(unit, files, {t: len(r) for t, r in data.items()}, size=size)
    dfs.put_all(payload)
    dfs.put_all({marker.rel: marker.encode()})


def run(units: int) -> dict[str, Any]:
    out: dict[str, Any] = {"units": units}
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        moto = bos.Moto(Path(tmp))
        try:
            os.environ.update(
                {
                    "AWS_ENDPOINT_URL": moto.endpoint,
                    "AWS_ACCESS_KEY_ID": bos.KEY,
                    "AWS_SECRET_ACCESS_KEY": bos.SECRET,
                    "AWS_REGION": bos.REGION,
                    "AWS_ALLOW_HTTP": "true",
                }
            )
            url = f"s3://{bos.BUCKET}/resume"
            dfs = DatasetFS(f"{bos.BUCKET}/resume", pafs.FileSystem.from_uri(url)[0])
            create_dataset(dfs)
            rows = bos.Rows()
            for _ in range(units):
                add_unit(dfs, rows, time.time_ns())

            def measure(name: str, fn: Callable[[], Any]) -> Any:
                before = moto.requests()
                t = time.perf_counter()
                value = fn()
                seconds = time.perf_counter() - t
                out[name] = {"s": round(seconds, 3), "requests": moto.requests() - before}
                return value

            sink = measure("open", lambda: ParquetSink(url))
            sink._following.set()  # measure the refreshes here, not in its follower thread
            if sink._follower is not None:
                sink._follower.join()
            reader = sink._reader
            first = int(list_markers(dfs)[0].split("-", 1)[0])
            add_unit(dfs, rows, first + 1)
            measure("interleaved", reader.refresh)
            compact_dataset(url, target_bytes=256 << 20, grace_s=600, shared_window_s=0)
            measure("compaction", reader.refresh)
            # A resume as a proxy's first call of a rollout makes it while compactions and other
            # writers go on: the refresh its read waits for, then the rollout's event log.
            rollout = reader.rollouts()[0]
            for _ in range(units // 10):
                add_unit(dfs, rows, time.time_ns())
            compact_dataset(url, target_bytes=256 << 20, grace_s=600, shared_window_s=0)
            add_unit(dfs, rows, first + 2)
            measure("resume", lambda: reader.events(rollout))
        finally:
            moto.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--units", type=int, default=300)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = run(args.units)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.units} units on moto S3")
    for step in ("open", "interleaved", "compaction", "resume"):
        r = result[step]
        print(f"  {step:<12} {r['s']:>8.3f} s {r['requests']:>6} requests")


if __name__ == "__main__":
    main()
