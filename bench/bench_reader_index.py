"""Memory of a proxy's units-indexed Parquet readers, by source line, per call of the store.

    .venv/bin/python bench/bench_reader_index.py DATASET [--top 12] [--json]

`DATASET` is a soak's dataset (``python -m scripts.soak --store parquet --dir D`` leaves it in
``D/ds``); it is copied to a temporary folder first and not changed. The copy is opened as the
proxy's two long-lived readers use it (`ParquetSource(..., index="units")`), each under
`tracemalloc` started after a first reader warmed up the imports:

* ``shared``: the proxy's shared reader (resume, manifests): indexes all but the newest unit,
  then the newest one in a second refresh (its steady state: units arrive a few at a time).
* ``writer``: the sink's own reader as it was before it was lent to the proxy (no key per
  call, ``call_keys=False``): one refresh, then `known` and `event_heads` (a writer's open),
  then the newest unit as above.
* ``lent``: the one reader a proxy now holds (the sink's, lent to the proxy:
  ``call_keys="on_demand"``, an 8 MiB cache), opened as ``writer``, then every 50th rollout
  resumed through it (info, summaries, coordinates, records, events: what a resume and a
  manifest read), then the newest unit. Its figure replaces ``shared`` + ``writer``.
* ``lent-keyed``: the same after one read by a key not read lately (a trainer fetching through
  the proxy's read routes), which makes it keep a key per call.

``shared`` and ``writer`` are the readers of a proxy before the sink lent its reader: on such a
release only they run (their sum is its figure).

For each (measured twice, the second run kept) it prints what the reader holds once its LRU
caches are cleared (the index) by file and line, in bytes and bytes per staged call. One process
on a shared machine: compare figures within a run, or runs of one dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

from capture_proxy.sinks.parquet import ParquetSink, ParquetSource


def _resume(source: ParquetSource, rollout_id: str) -> None:
    """What a resume or a manifest of `rollout_id` reads (`core.rollouts.resume_rollout`)."""
    with contextlib.suppress(KeyError):
        source.rollout_info(rollout_id)
    keys = [s.call_id for s in source.summaries(rollout_id)]
    source.coords(keys)
    source.fetch(keys)
    source.failures(rollout_id)
    source.events(rollout_id)


def _measure(ds: Path, mode: str, top: int, calls: int) -> dict[str, Any]:
    commits = ds / "_commits"
    newest = sorted(commits.glob("*.json"))[-1]
    aside = ds / newest.name
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    newest.rename(aside)
    if mode == "writer":
        try:
            source = ParquetSource(str(ds), index="units", call_keys=False)  # as the sink's
        except TypeError:  # a release before `call_keys`: its sink's reader kept them
            source = ParquetSource(str(ds), index="units")
    elif mode in ("lent", "lent-keyed"):
        source = ParquetSource(
            str(ds), index="units", call_keys="on_demand", cache_bytes=8 << 20
        )  # as `ParquetSink` opens it
    else:
        source = ParquetSource(str(ds), index="units")
    source.refresh()
    if mode != "shared":
        source.known()
        source.event_heads()
    if mode in ("lent", "lent-keyed"):
        for rollout_id in source.rollouts()[::50]:
            _resume(source, rollout_id)
    if mode == "lent-keyed":
        source.close_reader()  # nothing read lately: the read by key finds no recent ref
        source.coords([next(iter(ParquetSource(str(ds)).all_keys()))])
    aside.rename(newest)
    source.refresh()
    source.close_reader()  # the LRU caches: what is left is the index
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    stats = after.compare_to(before, "lineno")
    total = sum(s.size_diff for s in stats)
    return {
        "mode": mode,
        "calls": calls,
        "units": len(source._units),
        "rollouts": len(source.rollouts()),
        "index_bytes": total,
        "bytes_per_call": round(total / max(calls, 1), 1),
        "top": [
            {"where": s.traceback.format()[-1].strip(), "bytes": s.size_diff} for s in stats[:top]
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-reader-index-") as tmp:
        ds = Path(tmp) / "ds"
        shutil.copytree(args.dataset, ds)
        calls = sum(1 for _ in ParquetSource(str(ds)).all_keys())
        warm = ParquetSource(str(ds), index="units")  # imports and Arrow's first allocations
        warm.known()
        warm.event_heads()
        for rollout_id in warm.rollouts()[:20]:
            warm.rollout_info(rollout_id)
            warm.calls(rollout_id)
        del warm
        # Twice each, the second kept: a first run also grows tables that never shrink
        # (the interpreter's table of interned strings), which the proxy pays once.
        modes: tuple[str, ...] = ("shared", "writer")
        if hasattr(ParquetSink, "own_source"):  # else a release before the sink lent its reader
            modes += ("lent", "lent-keyed")
        runs = [_measure(ds, m, args.top, calls) for m in modes * 2]
        reports = runs[len(modes) :]
    for r in reports:
        if args.json:
            print(json.dumps(r))
            continue
        print(
            f"{r['mode']}: {r['calls']} calls, {r['units']} units, {r['rollouts']} rollouts: "
            f"index {r['index_bytes'] / 1e6:.2f} MB, {r['bytes_per_call']} B/call"
        )
        for row in r["top"]:
            print(
                f"{row['bytes'] / 1e3:10.1f} kB {row['bytes'] / max(r['calls'], 1):7.1f} B/call"
                f"  {row['where']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
