"""What a 10,000-unit Parquet dataset costs to open and to maintain on moto's S3 server.

    .venv/bin/python bench/bench_object_store_scale.py [--units 10000] [--new 200] [--json]

The scale half of bench/bench_object_store.py (which compares commit options): the store is a
dataset of `--units` committed units (one call each, 64 rollouts), compacted into one merged
unit whose marker retires all of them, within the grace period: every retired marker is still
listed, as after a compaction on a busy store. The units are named as committed two hours
before the build (`BUILT_AGO_S`), so every retired marker is before the checkpoint's horizon
(`_checkpoint`): opens list none of them, a full listing lists them all. It is built once on a
local folder and kept under the project's cache (``$CAPTURE_PROXY_CACHE`` else
~/.cache/capture-proxy, ``bench-object-store-scale/``), then uploaded to a fresh moto server
each run (the markers and the merged unit's files, concurrently through obstore; the retired
units' data files are left out: no open or compaction reads them, and a bulk delete of a
missing key is not an error).

Measured, on moto on loopback (started here, stopped at the end):

1. **open**: a new `ParquetSource` lists its rollouts, with the checkpoint (`_checkpoint`) and
   without it (the checkpoint object removed: how a dataset written before checkpoints opens,
   reading every listed marker);
2. **writer open**: a `ParquetSink` opened on the dataset (what a restarted proxy waits for
   before it is ready);
3. **compaction**: `--new` small units committed by a writer after the checkpoint, then
   `compact_dataset` with grace 0 and the CLI's default target (256 MB: the 160 MB merged unit
   is kept, the new units are merged): the seconds it holds the maintenance lease (as it reports
   them: it merges before taking it, and holds it to check and commit) and the
   seconds of the whole run (the clean-up deletes the retired units in bulk after the lease is
   released);
4. **open again** after the clean-up: no retired marker is left.

One run, on a shared machine: figures are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import obstore
from obstore.store import S3Store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_object_store import Rows, ledger_rows  # scripts run by path: siblings import flat

from capture_proxy.sinks.parquet import _compact
from capture_proxy.sinks.parquet._checkpoint import load_markers
from capture_proxy.sinks.parquet._compact import compact_dataset
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._layout import (
    BLOBS,
    CALLS,
    COMMITS_DIR,
    LEDGER,
    Marker,
    create_dataset,
    list_markers,
    new_unit_name,
    table_bytes,
    unit_files,
)
from capture_proxy.sinks.parquet._sink import ParquetSink
from capture_proxy.sinks.parquet._source import ParquetSource
from tests.support.s3 import MotoS3

#: The built dataset's recipe: a change to `build` bumps it (cached copies are rebuilt).
RECIPE = 3
#: How long before the build its units are named as committed (`commit_units`).
BUILT_AGO_S = 7200.0
BUCKET = "scale"
#: Concurrent uploads when copying the dataset to moto.
UPLOADS = 64


def cache_root() -> Path:
    root = os.environ.get("CAPTURE_PROXY_CACHE") or Path.home() / ".cache" / "capture-proxy"
    return Path(root) / "bench-object-store-scale"


def commit_units(dfs: DatasetFS, n: int, rows: Rows, last: int = 0, ago_s: float = 0.0) -> int:
    """`n` units of one call each, as a writer commits them; returns the last unit's order.
    With `ago_s`, named as if committed that long ago (a microsecond apart)."""
    past = time.time_ns() - int(ago_s * 1e9)
    for i in range(n):
        calls, blobs = rows.batch(1)
        tables = {CALLS: calls, BLOBS: blobs, LEDGER: ledger_rows(calls)}
        tables = {t: r for t, r in tables.items() if r}
        if ago_s:
            last = past + i * 1000
            unit = f"{last:020d}-{uuid.uuid4().hex[:12]}"
        else:
            unit, last = new_unit_name(last)
        files = unit_files(unit, tables)
        data = {files[t]: table_bytes(t, r) for t, r in tables.items()}
        marker = Marker(
            unit=unit,
            files=files,
            rows={t: len(r) for t, r in tables.items()},
            created_at_ms=int(time.time() * 1000),
            size=sum(map(len, data.values())),
        )
        dfs.put_all(data)
        dfs.put_all({marker.rel: marker.encode()})
    return last


def cached_dataset(units: int) -> tuple[Path, float | None]:
    """The compacted local dataset of `units` units (built once); the build's seconds if now."""
    kept = cache_root() / f"{units}-v{RECIPE}"
    if (kept / "done").exists():
        return kept / "ds", None
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    t = time.perf_counter()
    dfs = DatasetFS(str(kept / "ds"))
    create_dataset(dfs)
    # Named as committed two hours before: the checkpoint's horizon (its listing less
    # COMMIT_MARGIN_S) is after every one of them, as on a store some minutes after a compaction
    # (units committed within the margin before a compaction's listing are still listed).
    commit_units(dfs, units, Rows(), ago_s=BUILT_AGO_S)
    # Merged into one unit; the grace keeps every retired marker (and file) in place.
    compact_dataset(str(kept / "ds"), target_bytes=1 << 40, grace_s=1e9, shared_window_s=0)
    (kept / "done").write_text(f"{units} units, recipe {RECIPE}\n")
    return kept / "ds", time.perf_counter() - t


def upload(local: Path, store: S3Store) -> int:
    """The dataset's markers, checkpoint, format file and live units' files, to `store`."""
    dfs = DatasetFS(str(local))
    loaded = load_markers(dfs)
    rels = [f"{COMMITS_DIR}/{n}.json" for n in list_markers(dfs)]  # every name: retired too
    rels += [rel for m in loaded.live() for rel in m.files.values()]
    rels += ["_format.json", "_checkpoint/live.json"]
    return put_files(local, rels, store)


def put_files(local: Path, rels: list[str], store: S3Store) -> int:
    """The files `rels` (relative to `local`) to `store`, `UPLOADS` at a time; how many."""

    async def put_all() -> None:
        gate = asyncio.Semaphore(UPLOADS)

        async def one(rel: str) -> None:
            async with gate:
                await obstore.put_async(store, rel, (local / rel).read_bytes())

        await asyncio.gather(*(one(rel) for rel in rels))

    asyncio.run(put_all())
    return len(rels)


@contextlib.contextmanager
def reading_again_timer(loads: list[float]) -> Iterator[None]:
    """Record how long each maintenance run spends, holding the lease, reading the checkpoint
    and the listing again (when another run took the lease after its reading, made before it
    took the lease; bench-only instrumentation)."""
    checkpoint = _compact.Checkpoint  # type: ignore[attr-defined]

    class TimedCheckpoint(checkpoint):  # type: ignore[misc, valid-type]
        def hold(self, *args: Any, **kwargs: Any) -> None:
            t = time.perf_counter()
            super().hold(*args, **kwargs)
            loads.append(time.perf_counter() - t)

    setattr(_compact, "Checkpoint", TimedCheckpoint)  # noqa: B010 - no public name to patch
    try:
        yield
    finally:
        setattr(_compact, "Checkpoint", checkpoint)  # noqa: B010


def timed_open(url: str) -> tuple[float, int]:
    t = time.perf_counter()
    source = ParquetSource(url, index="units")
    n = len(source.rollouts())
    return time.perf_counter() - t, n


async def writer_open(url: str) -> float:
    t = time.perf_counter()
    sink = ParquetSink(url)
    elapsed = time.perf_counter() - t
    await sink.close()
    return elapsed


def run(units: int, new: int) -> dict[str, Any]:
    local, built_s = cached_dataset(units)
    out: dict[str, Any] = {"units": units, "built s": built_s}
    with tempfile.TemporaryDirectory() as tmp, MotoS3(Path(tmp), BUCKET) as moto:
        os.environ.update(moto.env)
        store = S3Store(BUCKET, prefix="ds", **_client(moto))
        url = f"s3://{BUCKET}/ds"
        t = time.perf_counter()
        out["uploaded objects"] = upload(local, store)
        out["upload s"] = time.perf_counter() - t
        t = time.perf_counter()
        out["listed markers"] = len(list_markers(DatasetFS(url)))
        out["list s (names only)"] = time.perf_counter() - t
        opened = load_markers(DatasetFS(url), None, url)
        out["names an open lists (after the horizon)"] = len(opened.names)
        out["open s (checkpoint, retired markers)"], out["rollouts"] = timed_open(url)
        out["writer open s (checkpoint)"] = asyncio.run(writer_open(url))
        checkpoint = bytes(obstore.get(store, "_checkpoint/live.json").bytes())
        obstore.delete(store, "_checkpoint/live.json")
        out["open s (no checkpoint)"], _ = timed_open(url)
        obstore.put(store, "_checkpoint/live.json", checkpoint)
        commit_units(DatasetFS(url), new, Rows())
        out["open s (checkpoint + new units)"], _ = timed_open(url)
        loads: list[float] = []
        t = time.perf_counter()
        with reading_again_timer(loads):
            stats = compact_dataset(url, target_bytes=256 << 20, grace_s=0, shared_window_s=0)
        out["compact s"] = time.perf_counter() - t
        out["compact lease held s"] = stats.lease_held_s
        out["  of which reading again s"] = loads[0]
        out["compact deleted files"] = stats.deleted_files
        out["open s (after clean-up)"], _ = timed_open(url)
        out["writer open s (after clean-up)"] = asyncio.run(writer_open(url))
    return out


def _client(moto: MotoS3) -> dict[str, Any]:
    env = moto.env
    return {
        "endpoint": moto.endpoint,
        "access_key_id": env["AWS_ACCESS_KEY_ID"],
        "secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region": env.get("AWS_REGION", "us-east-1"),
        "client_options": {"allow_http": True},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", type=int, default=10_000, help="units committed (default 10000)")
    ap.add_argument("--new", type=int, default=200, help="units committed after the checkpoint")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    result = run(args.units, args.new)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:40s} {shown}")


if __name__ == "__main__":
    main()
