"""Several proxies on one object-store dataset: calls/s, and object-store requests per call.

    .venv/bin/python bench/bench_s3_writers.py [--seconds 15] [--concurrency 12] [--calls 40]

Everything runs on this machine against moto's S3 server on loopback (`tests/support/s3.py`),
nothing leaves it. Two measurements, side by side in one run (compare them as ratios: the
machine is shared and noisy):

1. **Requests per call, before and after obstore writes.** One `ParquetSink` stages `--calls`
   calls of agent-like sessions one after another, each as a proxy does it: the admission claim
   (an event), then the record, one group commit each. "pyarrow" writes through a configured
   pyarrow `S3FileSystem` (`filesystem=`: every file a 3-request multipart upload, the claim a
   check then an upload: what the sink did before obstore); "obstore" through the dataset's URL
   (single-request ``PUT``s, the claim one conditional ``PUT``). Requests are counted from moto's
   request log: all of them (on object storage the sink's reader also follows the dataset every
   few seconds), and the writes alone.
2. **Calls/s, 1 proxy vs 3 proxies on one store.** Real ``capture-proxy serve`` processes on
   one ``s3://`` prefix, one shared fake vLLM process, `--concurrency` agent-like sandboxes in
   all (`tests/support/reliability_workers.Loader`: multi-turn, some streamed, some images),
   spread evenly over the proxies, for `--seconds`; counts the calls answered ``staged``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support: moto's server, the proxy processes, the load

import pyarrow.fs as pafs  # noqa: E402

from capture_proxy.schemas.events import claim_event  # noqa: E402
from capture_proxy.sinks.parquet import ParquetSink  # noqa: E402
from tests.support.reliability_workers import Loader, start_fake, start_proxy  # noqa: E402
from tests.support.s3 import MotoS3  # noqa: E402
from tests.support.sink_factories import Session  # noqa: E402

_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|PUT|POST|HEAD|DELETE) ')


def _requests(moto: MotoS3) -> tuple[int, int]:
    """Requests the server answered so far: all of them, and the writes (PUT and POST)."""
    time.sleep(0.2)  # the server logs a request after answering it
    methods = _REQUEST.findall(moto.log_path.read_text(errors="replace"))
    return len(methods), sum(1 for m in methods if m in ("PUT", "POST"))


async def _stage_calls(sink: ParquetSink, calls: int) -> None:
    sessions = [Session(f"bench-{i}") for i in range(4)]
    for n in range(calls):
        record, atts = sessions[n % len(sessions)].next()
        await sink.append_event(
            claim_event(record.rollout_id, record.seq, record.call_id, record.created_at_ms)
        )
        await sink.stage(record, attachments=atts)


async def requests_per_call(moto: MotoS3, calls: int) -> dict[str, float]:
    out: dict[str, float] = {}
    host = moto.endpoint.split("://", 1)[1]
    for option in ("pyarrow", "obstore"):
        url = moto.url()
        if option == "pyarrow":
            fs = pafs.S3FileSystem(
                access_key="testing",
                secret_key="testing",
                region="us-east-1",
                endpoint_override=host,
                scheme="http",
            )
            sink = ParquetSink(url.removeprefix("s3://"), url=url, filesystem=fs)
        else:
            sink = ParquetSink(url)
        try:
            await _stage_calls(sink, 4)  # each rollout's first call reads the store: not counted
            (before, writes_before), started = _requests(moto), time.perf_counter()
            await _stage_calls(sink, calls)
            elapsed = time.perf_counter() - started
            after, writes_after = _requests(moto)
            out[f"{option} requests/call"] = round((after - before) / calls, 1)
            out[f"{option} writes/call"] = round((writes_after - writes_before) / calls, 1)
            out[f"{option} ms/call"] = round(1000 * elapsed / calls, 1)
        finally:
            await sink.close()
    return out


async def calls_per_second(moto: MotoS3, proxies: int, concurrency: int, seconds: float) -> float:
    url = moto.url()
    fake = start_fake(latency=0.02)
    running = []
    try:
        for _ in range(proxies):
            p = start_proxy(fake.url, url, "--min-free-disk-mb", "0", cwd=ROOT)
            p.wait_ready(60)
            running.append(p)
        loaders = [
            Loader(f"x{proxies}-{i}", concurrency=concurrency // proxies, seed=i, turns=6)
            for i in range(proxies)
        ]
        for loader, p in zip(loaders, running, strict=True):
            loader.start(p.url)
        await asyncio.sleep(3)  # warm up: first calls, first rollouts
        first = sum(loader.outcomes["staged"] for loader in loaders)
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        done = sum(loader.outcomes["staged"] for loader in loaders) - first
        rate = done / (time.perf_counter() - started)
        for loader in loaders:
            await loader.stop()
        outcomes: Counter[str] = sum((loader.outcomes for loader in loaders), Counter())
        print(f"{proxies} prox{'y' if proxies == 1 else 'ies'}: {dict(outcomes)}", file=sys.stderr)
        return round(rate, 1)
    finally:
        for p in running:
            p.terminate()
        fake.terminate()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, MotoS3(Path(tmp)) as moto:
        old = moto.apply_env()
        try:
            result: dict[str, float] = await requests_per_call(moto, args.calls)
            for n in (1, 3):
                rate = await calls_per_second(moto, n, args.concurrency, args.seconds)
                result[f"calls/s, {n} prox{'y' if n == 1 else 'ies'}"] = rate
        finally:
            MotoS3.restore_env(old)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
