"""What verification on read costs a trainer: `Store.calls` and `Store.trajectory` of one
30-turn OpenCode-like session, with ``verify=True`` (the default) and ``verify=False``.

    .venv/bin/python bench/bench_read_verify.py [--turns 30] [--passes 7] [--sinks sqlite,parquet]

The session is bench_parquet.py's (a 10k-token system prompt and tools, 1,024 generated tokens a
turn, ~300 tokens of tool output), written as the proxy writes it: each call's admission claim,
its record (with its ``staged`` event), then the sealed header and its ``seal`` event.
A verified read checks every record's digest and the rollout's event log, its accounting and its
header (`capture_proxy.read.integrity`); the ratio verify=True / verify=False is printed, and
must stay at or under 2 (issue 29). Each pass opens a new reader (cold: files read and decoded),
as a trainer iterating over rollouts does; the Parquet dataset is compacted first. Reported per
sink: milliseconds per rollout and MB/s of token data (4 bytes per prompt id, completion id and
logprob of every call), with and without verification. Times are the median of `passes` runs;
the machine is shared, so expect noise.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench_parquet import build

from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import EventDraft, EventKind, claim_event
from capture_proxy.schemas.records import CallStatus, RolloutInfo, RolloutState, StagedCallRecord
from capture_proxy.sinks.base import StagingSink, StagingSource


async def _stage(sink: StagingSink, records: list[StagedCallRecord]) -> None:
    """The session as the proxy writes it: claims, records, a sealed header, the seal event."""
    rollout_id = records[0].rollout_id
    for r in records:
        await sink.append_event(claim_event(rollout_id, r.seq, r.call_id, r.created_at_ms))
        if (await sink.stage(r)).status is not CallStatus.STAGED:
            raise RuntimeError(f"{r.call_id}: not staged")
    now = int(time.time() * 1000)
    await sink.put_rollout(RolloutInfo(rollout_id, RolloutState.SEALED, False, now, now))
    await sink.append_event(EventDraft(rollout_id, EventKind.SEAL, now))
    await sink.close()


def _open(kind: str, where: Path) -> tuple[StagingSink, type[StagingSource], str]:
    where.mkdir(parents=True)
    if kind == "sqlite":
        from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource

        path = str(where / "capture.db")
        return SQLiteSink(path), SQLiteSource, path
    from capture_proxy.sinks.parquet import ParquetSink, ParquetSource

    path = str(where / "ds")
    return ParquetSink(path), ParquetSource, path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--sinks", default="sqlite,parquet")
    args = parser.parse_args()
    records = build(args.turns)
    rollout_id = records[0].rollout_id
    token_bytes = sum(4 * (r.cum_len + len(r.completion_logprobs)) for r in records)
    print(
        f"session: {len(records)} calls, {token_bytes / 1e6:.1f} MB of token data; "
        f"median of {args.passes} cold reads"
    )
    base = Path(tempfile.mkdtemp(prefix="bench-read-verify-"))
    try:
        for kind in args.sinks.split(","):
            sink, source_cls, path = _open(kind, base / kind)
            asyncio.run(_stage(sink, records))  # closes the sink
            if kind == "parquet":
                from capture_proxy.sinks.parquet import compact_store

                compact_store(path, grace_s=0)
            for what in ("calls", "trajectory"):
                times: dict[bool, list[float]] = {False: [], True: []}
                # Interleaved, after one warm-up read each: the page cache and the machine's
                # load then weigh on both alike.
                for i in range(args.passes + 1):
                    for verify in (False, True):
                        gc.collect()
                        t = time.perf_counter()
                        with Store(source_cls(path)) as store:  # type: ignore[call-arg]
                            getattr(store, what)(rollout_id, verify=verify)
                        if i:
                            times[verify].append(time.perf_counter() - t)
                off, on = statistics.median(times[False]), statistics.median(times[True])
                print(
                    f"{kind} {what}: verify=False {1000 * off:.0f} ms "
                    f"({token_bytes / off / 1e6:.0f} MB/s), verify=True {1000 * on:.0f} ms "
                    f"({token_bytes / on / 1e6:.0f} MB/s): verification "
                    f"+{1000 * (on - off):.0f} ms, ratio {on / off:.2f}"
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
