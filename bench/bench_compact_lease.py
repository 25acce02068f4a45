"""How long one ``capture-proxy compact`` holds the maintenance lease over a tail of small units,
on moto's S3 server.

    .venv/bin/python bench/bench_compact_lease.py [--units 100,200,600] [--baseline PATH] [--load]
        [--json]

The tail a minute's compaction meets (docs/storage.md, "A compaction every minute"): `--units`
small units as a proxy commits them under load, one staged call each (a record of an agent
session: its calls, blobs and ledger files), 8 sessions interleaved, written by a real
`ParquetSink` to a local folder, then uploaded to a fresh moto server on loopback (started here,
stopped at the end) under a prefix of its own for each checkout. Then the real command,
``capture-proxy compact --json`` in a process of its own, merges them into one unit, and the
bench reports the run's seconds and the seconds the lease was held: seen from outside (the lease
object polled every 0.1 s: held from the first poll that finds it held to the last; up to 0.1 s
short either way) and, when the checkout reports it, as the run says (``lease_held_s``).

With `--load`, a writer (a `ParquetSink` in the bench's process) stages calls into the store one
after another while each compaction runs, as the serving proxy does beside a deploy's
maintenance (its units land in the dataset the compaction lists and commits to).

With `--baseline PATH` (another checkout with its own ``.venv``: ``git worktree add --detach
/tmp/base main`` say), every size is compacted by both, in turn, on identical copies of the
tail, the same moto: a comparison side by side in one run.

One run, on a shared machine: figures are noisy; give the load average beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from obstore.store import S3Store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_object_store_scale import _client, put_files
from bench_restart import compact_once

from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._sink import ParquetSink
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "lease"
SESSIONS = 8


async def build(folder: Path, units: int) -> None:
    """`units` units of one staged call each, sessions interleaved (as a proxy's tail)."""
    sink = ParquetSink(str(folder), writer_id="bench")
    try:
        sessions = [Session(f"rollout-{i}") for i in range(SESSIONS)]
        for n in range(units):
            record, atts = sessions[n % SESSIONS].next()
            await sink.stage(record, attachments=atts)
    finally:
        await sink.close()


def upload(local: Path, store: S3Store) -> int:
    """Every file of the local dataset `local` (the writer's lock file aside) to `store`."""
    rels = [
        str(p.relative_to(local))
        for p in local.rglob("*")
        if p.is_file() and not p.name.endswith(".lock")
    ]
    return put_files(local, rels, store)


async def stage_meanwhile(url: str, stop: asyncio.Event) -> int:
    """A writer staging calls into `url` one after another until `stop`; how many it staged."""
    sink = await asyncio.to_thread(ParquetSink, url, writer_id="load")
    staged = 0
    try:
        session = Session("under-load")
        while not stop.is_set():
            record, atts = session.next()
            await sink.stage(record, attachments=atts)
            staged += 1
    finally:
        await sink.close()
    return staged


async def compact(tree: Path, url: str, lease: S3Store, load: bool) -> dict[str, Any]:
    """One ``capture-proxy compact --json`` of checkout `tree`: seconds, lease seen held; with
    `load`, a writer stages into the store meanwhile."""
    stop = asyncio.Event()
    writer = asyncio.create_task(stage_meanwhile(url, stop)) if load else None
    try:
        run = await compact_once(url, lease, tree=tree, grace_0=True)
    finally:
        stop.set()
    if writer is not None:
        run["staged meanwhile"] = await writer
    return run


def run(sizes: list[int], baseline: Path | None, load: bool) -> dict[str, Any]:
    trees = {"this": ROOT} if baseline is None else {"baseline": baseline, "this": ROOT}
    out: dict[str, Any] = {"load average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, MotoS3(Path(tmp) / "moto", BUCKET) as moto:
        os.environ.update(moto.env)
        for i, units in enumerate(sizes):
            local = Path(tmp) / f"tail-{i}"
            t = time.perf_counter()
            asyncio.run(build(local, units))
            row: dict[str, Any] = {"build s": round(time.perf_counter() - t, 1)}
            row["markers"] = sum(1 for _ in DatasetFS(str(local)).listdir("_commits"))
            # Each checkout first in turn, size by size (the machine's load changes meanwhile).
            order = list(trees.items())
            if i % 2:
                order.reverse()
            for name, tree in order:
                prefix = f"{name}-{i}"
                store = S3Store(BUCKET, prefix=prefix, **_client(moto))
                upload(local, store)
                lease = S3Store(BUCKET, prefix=prefix, **_client(moto))
                row[name] = asyncio.run(compact(tree, f"s3://{BUCKET}/{prefix}", lease, load))
            row["load average after"] = os.getloadavg()
            out[f"{units} units" + (f" ({i + 1})" if sizes.count(units) > 1 else "")] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--units", default="100,200,600", help="tail sizes, comma-separated")
    ap.add_argument("--baseline", type=Path, help="another checkout (with its .venv) to compare")
    ap.add_argument(
        "--load", action="store_true", help="a writer stages into the store during each compaction"
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    sizes = [int(n) for n in args.units.split(",")]
    result = run(sizes, args.baseline, args.load)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
