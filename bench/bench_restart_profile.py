"""Where a restarted proxy's store open goes, on the 10,000-unit moto dataset under load.

    .venv/bin/python bench/bench_restart_profile.py [--opens 4] [--every 8] [--baseline PATH]

The dataset and the load are bench/bench_restart.py's: the compacted 10,000-unit dataset
uploaded to a fresh moto server, another proxy on it serving four agent-like sandboxes. Every
`--every` seconds a `ParquetSink` is opened in a child process of its own (as a restarted proxy
opens its store; its own interpreter, so the load's client does not share its GIL), with
timers around the steps of the open (bench-only instrumentation, patched in the child):

- **checkpoint**, **listing**: reading ``_checkpoint/live.json``, listing the names after its
  horizon;
- **markers**: reading the markers of the units committed since the checkpoint (the tail);
- **fetch**: fetching the tail's small files (in a thread, overlapping the indexing);
- **large unit**, **small units**: indexing the compacted unit, and the tail's units;
- **attachments again**: a second read of every attachments file for what the writer must
  know (`Loading._attachment_files`; absent when the open's own pass collects them).

With `--baseline PATH` (another checkout) the opens alternate between that checkout's code and
this one's, on the same store under the same load. The tail grows during the run: later opens
index more units. One line of JSON per open; give the load average beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from obstore.store import S3Store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_object_store_scale import BUCKET, _client, cached_dataset, upload

from tests.support.reliability_workers import Loader, start_fake, start_proxy
from tests.support.s3 import MotoS3

ROOT = Path(__file__).resolve().parents[1]

#: What the child runs: the open, timed by step (`CODE` is the checkout whose code it imports).
_CHILD = r"""
import functools, json, os, sys, time
sys.path.insert(0, os.environ["CODE"])
from capture_proxy.sinks.parquet import _checkpoint, _loading, _source
from capture_proxy.sinks.parquet._sink import ParquetSink

took, calls = {}, {}

def timed(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            took[label] = took.get(label, 0.0) + time.perf_counter() - t
            calls[label] = calls.get(label, 0) + 1
    setattr(owner, name, run)

timed(_checkpoint, "read_checkpoint", "checkpoint")
timed(_checkpoint, "list_markers", "listing")
timed(_checkpoint, "read_markers", "markers")
import capture_proxy.sinks.parquet._snapshot as _snapshot
for owner in (_source, _snapshot):  # where the checkout's open calls it from
    if hasattr(owner, "fetch_files"):
        timed(owner, "fetch_files", "fetch")
timed(_loading.Loading, "_attachment_files", "attachments again")
add = _source.ParquetSource._add_unit
def add_unit(self, unit):
    t = time.perf_counter()
    add(self, unit)
    label = "large unit" if unit.size > (1 << 20) else "small units"
    took[label] = took.get(label, 0.0) + time.perf_counter() - t
    calls[label] = calls.get(label, 0) + 1
_source.ParquetSource._add_unit = add_unit
t = time.perf_counter()
sink = ParquetSink(sys.argv[1])
out = {"open s": round(time.perf_counter() - t, 2), "units": len(sink._reader._units)}
out.update({f"{k} s (x{calls[k]})": round(v, 2) for k, v in took.items()})
print(json.dumps(out))
os._exit(0)
"""


def open_once(store: str, code: Path) -> dict[str, object]:
    env = {**os.environ, "CODE": str(code)}
    argv = [sys.executable, "-c", _CHILD, store]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=code, env=env, timeout=300)
    if done.returncode:
        raise RuntimeError(f"the open failed:\n{done.stderr[-3000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def run(opens: int, every: float, baseline: Path | None) -> None:
    local, _ = cached_dataset(10_000)
    with tempfile.TemporaryDirectory() as tmp, MotoS3(Path(tmp), BUCKET) as moto:
        os.environ.update(moto.env)
        target = S3Store(BUCKET, prefix="ds", **_client(moto))
        t = time.perf_counter()
        await asyncio.to_thread(upload, local, target)
        print(json.dumps({"upload s": round(time.perf_counter() - t, 1)}), flush=True)
        store = f"s3://{BUCKET}/ds"
        fake = start_fake(latency=0.02)
        writer = start_proxy(fake.url, store, "--min-free-disk-mb", "0", cwd=ROOT)
        writer.wait_ready(170)
        loader = Loader("restart-load", concurrency=4, seed=1, turns=6)
        loader.start(writer.url)
        try:
            for i in range(opens):
                await asyncio.sleep(every)
                code = baseline if baseline is not None and i % 2 == 0 else ROOT
                label = "baseline" if code == baseline else "this"
                out = await asyncio.to_thread(open_once, store, code)
                seen = {"load": round(os.getloadavg()[0], 1), "staged": loader.outcomes["staged"]}
                print(json.dumps({"code": label, **seen, **out}), flush=True)
        finally:
            await loader.stop()
            writer.terminate(30)
            fake.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--opens", type=int, default=4, help="opens timed (default 4)")
    ap.add_argument("--every", type=float, default=8.0, help="seconds of load before each")
    ap.add_argument("--baseline", type=Path, help="another checkout, opened in turn (compared)")
    args = ap.parse_args()
    asyncio.run(run(args.opens, args.every, args.baseline))


if __name__ == "__main__":
    main()
