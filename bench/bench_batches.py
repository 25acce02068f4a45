"""Reads a trainer makes on a store of 10,000 rollouts, local and through a proxy's read routes.

    .venv/bin/python bench/bench_batches.py [--rollouts 10000] [--kinds sqlite,parquet] [--json]

For each store kind, a store of `--rollouts` sealed, graded rollouts (one staged call each, groups
of four, sealed one a second) is written through the sink directly (500 rollouts at
once, so the sink's group commits batch them; no HTTP), once: it is kept under the project's cache
(``bench-batches/<kind>-<n>-v<recipe>``) and each run reads a fresh copy of it. Building costs
about 5 s (SQLite) and 40-80 s (Parquet, on a loaded machine) the first time. Then, timed:

* ``open``: `open_store` and its first `rollouts()` (every id).
* ``list sealed`` / ``list group`` / ``list since``: `Store.rollouts(state="sealed")`, one group
  (4 rollouts), the last 1% by seal time (100 rollouts), each from the rollout index; the first
  query of a Parquet reader builds its index (``index build``), later ones are ``warm``. Beside
  them, ``scan group``: the same group found by reading every header, as a client did before
  (`sinks.rollout_index.scan_headers`).
* ``calls x50``: `Store.calls` of 50 rollouts (verified).
* ``next batch``: `Store.next_batch` of 8 rollouts and its `ack`, and of 4 groups of 4, p50 over
  several batches, for a consumer starting on the whole store (every rollout a candidate), and
  ``caught up``: for one that took all but the last 48 (a trainer keeping up with its proxy; its
  cursor is written into the store before the run).

Remote: ``capture-proxy serve --upstream fake`` on the same store (a process of its own, on
127.0.0.1), read with ``open_store("http://...", token=reader)``: the same reads.

One run on a shared machine: compare within a run. The whole run stays under two minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from capture_proxy.read.cursor import ExportCursor
from capture_proxy.read.reader import Store, open_store
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.rollout_index import RolloutQuery, scan_headers
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.support.batch_store import Spec, put_header, store_path
from tests.support.sink_factories import Session

TOKEN = "bench-admin-token-0123456789"
READER = "bench-reader-token-0123456789"
GROUP_SIZE = 4
#: Seal times: one rollout a second from here (10,000 rollouts: under three hours).
SEALED_FROM = 1_700_000_000_000
#: The built store's recipe: a change to `build` bumps it (the cached copies are rebuilt).
RECIPE = 2


async def build(kind: str, folder: Path, n: int) -> str:
    """`n` sealed, graded rollouts, `GROUP_SIZE` to a group, written `chunk` at a time."""
    path, url = store_path(kind, folder)
    # Group commits as large as a chunk: building is not what is measured.
    sink = SQLiteSink(str(path)) if kind == "sqlite" else ParquetSink(str(path))
    chunk = 500

    async def one(i: int) -> None:
        session = Session(f"r{i:05d}")
        await sink.stage(session.next(new_prompt=16, completion=8)[0])
        spec = Spec(
            f"r{i:05d}", group=f"g{i // GROUP_SIZE:05d}", sealed_at_ms=SEALED_FROM + i * 1000
        )
        await put_header(sink, spec)

    try:
        for start in range(0, n, chunk):
            await asyncio.gather(*(one(i) for i in range(start, min(n, start + chunk))))
    finally:
        await sink.close()
    return url


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t) * 1000, out


def reads(store: Store, n: int, consumer: str) -> dict[str, float]:
    """The timed reads of one open store (ms)."""
    out: dict[str, float] = {}
    group = f"g{(n // GROUP_SIZE) // 2:05d}"
    since = SEALED_FROM + (n - n // 100) * 1000
    out["list sealed (first query; Parquet: builds the index)"], _ = timed(
        lambda: store.rollouts(state="sealed")
    )
    out["list sealed (warm)"], ids = timed(lambda: store.rollouts(state="sealed"))
    assert len(ids) == n, len(ids)
    out["list group (warm)"], got = timed(lambda: store.rollouts(group=group))
    assert len(got) == GROUP_SIZE, got
    out["list since, 1% (warm)"], got = timed(lambda: store.rollouts(since=since))
    assert len(got) == n // 100, len(got)
    query = RolloutQuery(groups=frozenset([group]))
    out["scan group (every header, as before)"], got = timed(
        lambda: scan_headers(store.source, query)
    )
    assert len(got) == GROUP_SIZE
    some = ids[n // 3 : n // 3 + 50]
    out["calls x50 (verified)"], _ = timed(lambda: [store.calls(r) for r in some])
    asks: list[tuple[str, str, dict[str, int]]] = [
        ("next batch 8 rollouts + ack", "rollouts", {"rollouts": 8}),
        ("next batch 4 groups of 4 + ack", "groups", {"groups": 4, "group_size": GROUP_SIZE}),
    ]
    for name, suffix, ask in asks:
        times = []
        for _ in range(6):

            def take(ask: dict[str, int] = ask, suffix: str = suffix) -> Any:
                return store.next_batch(f"{consumer}-{suffix}", wait_s=0, **ask)

            ms, batch = timed(take)
            assert batch is not None
            ack_ms, _ = timed(batch.ack)
            times.append(ms + ack_ms)
        out[f"{name} (first)"] = times[0]
        out[f"{name} (p50 of 6)"] = statistics.median(times)
    # A trainer keeping up: all but the last 48 rollouts taken (its cursor, as the store keeps
    # it, written before the run), so a poll reads from its horizon, not from the start.
    times = []
    for _ in range(6):
        ms, batch = timed(lambda: store.next_batch(f"{consumer}-caught-up", rollouts=8, wait_s=0))
        assert batch is not None
        ack_ms, _ = timed(batch.ack)
        times.append(ms + ack_ms)
    out["caught up: next batch 8 + ack (first: a full pass)"] = times[0]
    out["caught up: next batch 8 + ack (p50 of 6)"] = statistics.median(times)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capture_proxy",
            "serve",
            "--upstream",
            "fake",
            "--store",
            url,
            "--port",
            str(port),
            "--admin-token",
            TOKEN,
            "--reader-token",
            READER,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/healthz", timeout=1):
                return proc, base
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the proxy did not start within 60 s")


def cached_store(kind: str, n: int, into: Path) -> tuple[str, float | None]:
    """A copy in `into` of the store built once per kind and size (kept under the project's
    cache, `$CAPTURE_PROXY_CACHE` else ~/.cache/capture-proxy); the build's seconds when it was
    built now. Each run reads a fresh copy: runs write cursors and proxy state into it."""
    root = Path(os.environ.get("CAPTURE_PROXY_CACHE") or Path.home() / ".cache" / "capture-proxy")
    kept = root / "bench-batches" / f"{kind}-{n}-v{RECIPE}"
    built_s = None
    if not (kept / "done").exists():
        shutil.rmtree(kept, ignore_errors=True)
        kept.mkdir(parents=True)
        t = time.perf_counter()
        asyncio.run(build(kind, kept, n))
        built_s = time.perf_counter() - t
        (kept / "done").write_text(f"{n} rollouts, recipe {RECIPE}\n")
    path, url = store_path(kind, into)
    src, _ = store_path(kind, kept)
    if src.is_dir():
        shutil.copytree(src, path)
    else:
        shutil.copyfile(src, path)
    return url, built_s


def run_kind(kind: str, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        url, built_s = cached_store(kind, n, Path(tmp))
        result: dict[str, Any] = {"build s": built_s}
        with open_store(url) as store:
            taken = ExportCursor(store.rollouts()[: n - 48]).to_json()
            cursors = store.source.consumer_cursors()  # type: ignore[attr-defined]
            for where in ("local", "remote"):
                cursors.save(f"{where}-caught-up", taken, 0)
        ms, store = timed(lambda: open_store(url))
        ms2, _ = timed(store.rollouts)
        local = {"open + rollouts()": ms + ms2, **reads(store, n, "local")}
        store.close()
        result["local"] = local
        proc, base = serve(url)
        try:
            ms, store = timed(lambda: open_store(base, token=READER))
            ms2, _ = timed(store.rollouts)
            remote = {"open + rollouts()": ms + ms2, **reads(store, n, "remote")}
            store.close()
        finally:
            proc.terminate()
            proc.wait(10)
        result["remote"] = remote
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=10_000)
    ap.add_argument("--kinds", default="sqlite,parquet")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = {kind: run_kind(kind, args.rollouts) for kind in args.kinds.split(",")}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for kind, res in results.items():
        built = res["build s"]
        how = "from the cache" if built is None else f"built in {built:.1f} s"
        print(f"{kind}: {args.rollouts} rollouts ({how})")
        for where in ("local", "remote"):
            for name, ms in res[where].items():
                print(f"  {where:6} {name:44} {ms:9.1f} ms")


if __name__ == "__main__":
    main()
