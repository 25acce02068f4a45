"""What keeping the store head costs (docs/digest.md, "The store head").

    .venv/bin/python bench/bench_store_head.py [--rollouts 100000] [--sessions 16] [--turns 6]

Four figures:

* the state's own operations: one rollout's head moved (`StoreHeadState.advance`: two leaves,
  a subtraction, an addition) and the head of the state (`head`: SHA-256 of 2 KiB);
* opening a store of `--rollouts` rollouts (`StoreHeadState.of` over their heads: what a writer
  does once at open, besides reading the heads), and listing the claim files of a Parquet
  dataset of as many rollouts (`_claims.claim_counts`, what its writer also does at open);
* on the SQLite writer thread and on the Parquet one (a local folder) as the proxy writes
  (claims, then records, 8 calls a commit, `sqlite_writer_cpu.py`'s workload): the CPU the
  store head takes per call (`StoreHeadKeeper.committed`, and on Parquet the claim files'
  part, `_claim_head.ClaimedHead.created`), next to the writer thread's whole CPU per call.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

from bench_staging import Session

from capture_proxy.schemas.events import claim_event
from capture_proxy.schemas.store_head import StoreHeadState
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.sqlite import SQLiteSink


def _state_ops() -> None:
    state = StoreHeadState()
    a, b = "a" * 64, "b" * 64
    state.advance("r", "", a)
    n = 20_000
    advance = timeit.timeit(lambda: state.advance("r", a, b), number=n) / n
    head = timeit.timeit(state.head, number=n) / n
    print(f"advance one rollout's head: {advance * 1e6:.1f} µs; the head: {head * 1e6:.1f} µs")


def _open(rollouts: int, folder: Path) -> None:
    heads = [(f"rollout-{i:08d}", f"{i:064x}", 9) for i in range(rollouts)]
    t0 = time.perf_counter()
    StoreHeadState.of(heads)
    print(f"open: the state of {rollouts} rollouts in {time.perf_counter() - t0:.2f} s")
    try:
        from capture_proxy.sinks.parquet._claims import claim_counts
    except ImportError:  # a version whose head does not cover claim files
        return
    for i in range(rollouts):  # ten claim files a rollout, empty: only their names are read
        claims = folder / "claims" / f"rollout-{i:08d}"
        claims.mkdir(parents=True)
        for seq in range(10):
            (claims / f"{seq:010d}").touch()
    t0 = time.perf_counter()
    counted = claim_counts(DatasetFS(str(folder)))
    took = time.perf_counter() - t0
    assert len(counted) == rollouts
    print(f"open: the claim files of {rollouts} rollouts (10 each) counted in {took:.2f} s")


async def _writer(kind: str, folder: Path, sessions: int, turns: int, group: int = 8) -> None:
    people = [Session(f"w{i}", i) for i in range(sessions)]
    records = [p.next() for _ in range(turns) for p in people]
    sink: Any = (
        SQLiteSink(str(folder / "w.db")) if kind == "sqlite" else ParquetSink(str(folder / "ds"))
    )
    writer: Any = sink._writer  # the bench times the writer's commits and the keeper's part
    spent = {"writer": 0.0, "keeper": 0.0, "batches": 0.0}
    commit, committed = writer._commit, sink.store_head.committed
    created: Any = getattr(
        getattr(sink, "_holders", None), "_on_created", None
    )  # Parquet: the claim files' part

    def timed_commit(jobs: Any) -> None:
        t0 = time.thread_time()
        try:
            commit(jobs)
        finally:
            spent["writer"] += time.thread_time() - t0
            spent["batches"] += 1

    def timed_keeper(*args: Any) -> None:
        t0 = time.thread_time()
        try:
            committed(*args)
        finally:
            spent["keeper"] += time.thread_time() - t0

    def timed_created(claims: Any) -> None:
        t0 = time.thread_time()
        try:
            created(claims)
        finally:
            spent["keeper"] += time.thread_time() - t0

    writer._commit = timed_commit
    sink.store_head.committed = timed_keeper
    if created is not None:
        sink._holders._on_created = timed_created
    try:
        for start in range(0, len(records), group):
            chunk = records[start : start + group]
            await asyncio.gather(
                *(
                    sink.append_event(claim_event(r.rollout_id, r.seq, r.call_id, r.created_at_ms))
                    for r in chunk
                )
            )
            await asyncio.gather(*(sink.stage(r) for r in chunk))
    finally:
        await sink.close()
    calls = len(records)
    print(
        f"{kind} writer thread: {calls} calls, {spent['batches']:.0f} commits; writer CPU "
        f"{1000 * spent['writer'] / calls:.3f} ms per call, of which the store head "
        f"{1e6 * spent['keeper'] / calls:.1f} µs per call "
        f"({1e6 * spent['keeper'] / spent['batches']:.1f} µs per commit, "
        f"{100 * spent['keeper'] / spent['writer']:.1f}%)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=100_000)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    args = p.parse_args()
    _state_ops()
    with tempfile.TemporaryDirectory(prefix="store-head-") as tmp:
        _open(args.rollouts, Path(tmp))
    for kind in ("sqlite", "parquet"):
        with tempfile.TemporaryDirectory(prefix="store-head-") as tmp:
            asyncio.run(_writer(kind, Path(tmp), args.sessions, args.turns))


if __name__ == "__main__":
    main()
