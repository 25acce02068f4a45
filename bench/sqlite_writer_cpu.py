"""CPU of the SQLite writer thread per captured call, in-process: the sink's share of a call.

    .venv/bin/python bench/sqlite_writer_cpu.py [--sessions 32] [--turns 8] [--group 8]

Writes what the proxy writes for each call, in the order it writes it under load: `group`
calls at a time (the group commit of a loaded proxy holds several), each an admission claim
(`append_event`) and then its sealed record (`stage`), over `sessions` interleaved agent
sessions of `turns` calls each (`bench_staging.Session`: a 16k-token context growing ~2k
tokens a turn, the history re-sent every call). Records are built and sealed before the clock
starts. Reports the writer thread's CPU (``time.thread_time`` around each batch's commit: the
statements, the record's encoding, ``COMMIT`` with its fsync) per call, the batches it took, and
the calls' own work within the batches (each claim's and record's statements and encoding,
without ``BEGIN``/``COMMIT``: the part a change to the statements moves, and less noisy, since
the fsync's CPU depends on what else the disk is doing), and the CPU of each batch besides
that (``BEGIN``, ``COMMIT`` with its WAL write and fsync, the checkpoints): a loaded proxy's
group commits hold a few calls each, so that fixed cost is paid every few calls.

Run it from two checkouts (each with its own ``.venv``) to compare a change to the writer: the
figures are CPU time of one thread, so other work on the machine inflates them less than wall
time, but still run the two alternately, several times.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_staging import Session

from capture_proxy.schemas.events import claim_event
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.sinks.sqlite import SQLiteSink


async def _run(
    folder: Path, sessions: int, turns: int, group: int
) -> tuple[float, float, int, int]:
    people = [Session(f"w{i}", i) for i in range(sessions)]
    # Interleaved as the load generator's sessions are: turn by turn, session by session.
    records: list[StagedCallRecord] = [p.next() for _ in range(turns) for p in people]
    sink = SQLiteSink(str(folder / "w.db"))
    writer: Any = sink._writer  # the bench times the writer's commits; nothing else changes
    spent = [0.0, 0.0]  # the batches' whole commits, the jobs' own work within them
    commit = writer._commit

    def timed_work(work: Any) -> Any:
        def run(conn: Any, batch: Any) -> Any:
            t0 = time.thread_time()
            try:
                return work(conn, batch)
            finally:
                spent[1] += time.thread_time() - t0

        return run

    def timed(jobs: Any) -> None:
        for job in jobs:
            job.work = timed_work(job.work)
        t0 = time.thread_time()
        try:
            commit(jobs)
        finally:
            spent[0] += time.thread_time() - t0

    writer._commit = timed
    try:
        warm = len(people)  # the first turn of every session opens the file's caches
        for start in range(0, len(records), group):
            chunk = records[start : start + group]
            if start == warm:
                spent[:], batches0 = [0.0, 0.0], writer.batches
            claims = [
                sink.append_event(claim_event(r.rollout_id, r.seq, r.call_id, r.created_at_ms))
                for r in chunk
            ]
            await asyncio.gather(*claims)
            results = await asyncio.gather(*(sink.stage(r) for r in chunk))
            for r, result in zip(chunk, results, strict=True):
                if result.status.value != "staged":
                    raise RuntimeError(f"{r.call_id} was not staged: {result}")
        calls = len(records) - warm
        return spent[0], spent[1], calls, writer.batches - batches0
    finally:
        await sink.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="calls written together")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    per_call, work_per_call, per_commit = [], [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="writer-cpu-") as tmp:
            spent, work, calls, batches = asyncio.run(
                _run(Path(tmp), args.sessions, args.turns, args.group)
            )
        per_call.append(1000 * spent / calls)
        work_per_call.append(1000 * work / calls)
        per_commit.append(1000 * (spent - work) / batches)
        print(
            f"{calls} calls, {batches} batches: writer CPU {per_call[-1]:.3f} ms per call, "
            f"of which the calls' own work {work_per_call[-1]:.3f} ms; "
            f"{per_commit[-1]:.3f} ms per batch besides (BEGIN, COMMIT with its fsync)"
        )
    print(
        f"median writer CPU per call: {statistics.median(per_call):.3f} ms; the calls' own "
        f"work (statements, encoding; not BEGIN/COMMIT): {statistics.median(work_per_call):.3f} "
        f"ms; per batch besides: {statistics.median(per_commit):.3f} ms"
    )


if __name__ == "__main__":
    main()
