"""Staging throughput, latency and storage size of the sinks.

    .venv/bin/python bench/bench_staging.py [--quick] [--sinks sqlite,parquet] [--json]

(a) `sessions` concurrent agent sessions, each staging turn after turn: a 16k-token context that
    grows by ~1k new prompt tokens and ~1k completion tokens (with logprobs) per turn. Reports
    durable records/s (a record counts once `stage` has returned: committed and synced) and the
    p50/p99 latency of `stage`.
(b) independent 16k-token records (no parent), staged with the same concurrency: records/s.
(c) one 20-turn session: bytes on disk vs the raw unique content (4 bytes a token, 4 bytes a
    generated logprob, the conversation's text once) and vs storing every call's full prompt.

Records are built and sealed before the clock starts: sealing is the caller's cost. Results are
in docs/storage.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.records import CallStatus, StagedCallRecord
from capture_proxy.sinks.base import StagingSink

CONTEXT_TOKENS = 16_384
TURN_PROMPT_TOKENS = 1_024
TURN_COMPLETION_TOKENS = 1_024
BYTES_PER_TOKEN_OF_TEXT = 4  # roughly what a BPE tokenizer gives on English and code
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "that",
    "with",
    "as",
    "it",
    "by",
    "this",
    "be",
    "are",
    "from",
    "or",
    "at",
    "an",
    "you",
]


def _ids(rng: random.Random, n: int) -> array[int]:
    return array("i", [rng.randrange(150_000) for _ in range(n)])


def _text(rng: random.Random, tokens: int) -> str:
    out: list[str] = []
    size = 0
    while size < tokens * BYTES_PER_TOKEN_OF_TEXT:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "x" * 900,
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
        },
    }
    for i in range(10)
]


class Session:
    """A session whose first prompt is a 16k-token context, growing ~2k tokens per turn."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.rng = random.Random(seed)
        self.full = array("i")
        self.parent: str | None = None
        self.seq = 0
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": _text(self.rng, CONTEXT_TOKENS // 4)},
            {"role": "user", "content": _text(self.rng, CONTEXT_TOKENS * 3 // 4)},
        ]

    def next(self, *, parent: bool = True) -> StagedCallRecord:
        prompt = array("i", self.full)
        prompt.extend(_ids(self.rng, CONTEXT_TOKENS if not self.full else TURN_PROMPT_TOKENS))
        completion = _ids(self.rng, TURN_COMPLETION_TOKENS)
        logprobs = array("f", [-self.rng.random() * 8 for _ in range(TURN_COMPLETION_TOKENS)])
        call_id = f"{self.name}-c{self.seq}"
        response = {"role": "assistant", "content": _text(self.rng, TURN_COMPLETION_TOKENS)}
        record = seal_record(
            StagedCallRecord(
                rollout_id=self.name,
                call_id=call_id,
                seq=self.seq,
                model="bench-model",
                finish_reason="stop",
                request={
                    "model": "bench-model",
                    "messages": list(self.messages),
                    "tools": TOOLS,
                    "stream": True,
                    "max_tokens": 32000,
                },
                response=response,
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                completion_logprobs=logprobs,
                parent_call_id=self.parent if parent else None,
                upstream_version="0.32.0",
                sampling={"temperature": 1.0},
            )
        )
        self.full = array("i", prompt)
        self.full.extend(completion)
        self.parent = call_id
        self.seq += 1
        self.messages = [
            *self.messages,
            response,
            {"role": "tool", "tool_call_id": "t", "content": _text(self.rng, TURN_PROMPT_TOKENS)},
        ]
        return record


SinkMaker = Callable[[Path], StagingSink]


def _makers() -> dict[str, SinkMaker | str]:
    from capture_proxy.sinks.sqlite import SQLiteSink

    makers: dict[str, SinkMaker | str] = {"sqlite": lambda d: SQLiteSink(str(d / "bench.db"))}
    try:
        from capture_proxy.sinks.parquet import ParquetSink

        makers["parquet"] = lambda d: ParquetSink(str(d / "dataset"))
    except ImportError as e:  # another engineer's sink may not be there yet
        makers["parquet"] = f"skipped: capture_proxy.sinks.parquet does not import ({e})"
    return makers


async def _stage_all(sink: StagingSink, lanes: list[list[StagedCallRecord]]) -> dict[str, float]:
    """Each lane stages its records in order; lanes run concurrently. Returns the figures."""
    latencies: list[float] = []

    async def lane(records: list[StagedCallRecord]) -> None:
        for record in records:
            t = time.perf_counter()
            result = await sink.stage(record)
            latencies.append(time.perf_counter() - t)
            if result.status is not CallStatus.STAGED:
                raise RuntimeError(f"{record.call_id} was not staged: {result}")

    gc.collect()
    start = time.perf_counter()
    await asyncio.gather(*(lane(rs) for rs in lanes))
    elapsed = time.perf_counter() - start
    await sink.close()
    latencies.sort()
    n = len(latencies)
    return {
        "records": n,
        "seconds": elapsed,
        "records_per_s": n / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(n - 1, int(n * 0.99))],
    }


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_sessions(make: SinkMaker, where: Path, sessions: int, turns: int) -> dict[str, float]:
    built = [
        [s.next() for _ in range(turns)] for s in (Session(f"s{i}", i) for i in range(sessions))
    ]
    return asyncio.run(_run(make, where, built))


def bench_independent(make: SinkMaker, where: Path, count: int, lanes: int) -> dict[str, float]:
    records = [Session(f"i{i}", 10_000 + i).next(parent=False) for i in range(count)]
    built = [records[i::lanes] for i in range(lanes)]
    return asyncio.run(_run(make, where, built))


async def _run(
    make: SinkMaker, where: Path, built: list[list[StagedCallRecord]]
) -> dict[str, float]:
    return await _stage_all(make(where), built)


def bench_size(make: SinkMaker, where: Path, turns: int) -> dict[str, float]:
    session = Session("size", 99)
    records = [session.next() for _ in range(turns)]
    asyncio.run(_run(make, where, [records]))
    on_disk = _dir_bytes(where)
    last = records[-1]
    unique_tokens = len(last.prompt_token_ids) + len(last.completion_token_ids)
    generated = sum(len(r.completion_logprobs) for r in records)
    messages = [*last.request["messages"], last.response]
    text = sum(len(orjson.dumps(m)) for m in messages)
    text += len(orjson.dumps({k: v for k, v in last.request.items() if k != "messages"}))
    raw = 4 * unique_tokens + 4 * generated + text
    full_prompt = sum(
        4 * r.cum_len
        + 4 * len(r.completion_logprobs)
        + len(orjson.dumps(dict(r.request)))
        + len(orjson.dumps(dict(r.response)))
        for r in records
    )
    return {
        "turns": turns,
        "bytes_on_disk": on_disk,
        "raw_unique_bytes": raw,
        "ratio_to_raw": on_disk / raw,
        "full_prompt_bytes": full_prompt,
        "ratio_to_full_prompt": on_disk / full_prompt,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (< 30 s)")
    parser.add_argument("--sinks", default="sqlite,parquet")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    parser.add_argument("--dir", help="where to write the stores (default: a temporary folder)")
    args = parser.parse_args()
    turns = 3 if args.quick else 8
    independent = 128 if args.quick else 512
    print(
        f"# {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}; "
        f"{' '.join(sys.argv[1:]) or '(full run)'}"
    )
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-staging-"))
    makers = _makers()
    results: dict[str, Any] = {}
    try:
        for name in args.sinks.split(","):
            make = makers.get(name)
            if make is None or isinstance(make, str):
                print(f"{name}: {make or 'unknown sink'}")
                continue
            r: dict[str, Any] = {}
            r["sessions"] = bench_sessions(make, base / f"{name}-a", args.sessions, turns)
            r["independent"] = bench_independent(
                make, base / f"{name}-b", independent, args.sessions
            )
            r["size"] = bench_size(make, base / f"{name}-c", 20)
            results[name] = r
            a, b, c = r["sessions"], r["independent"], r["size"]
            print(
                f"{name}: (a) {args.sessions} sessions x {turns} turns: "
                f"{a['records_per_s']:.0f} durable records/s, "
                f"stage p50 {a['p50_ms']:.1f} ms, p99 {a['p99_ms']:.1f} ms\n"
                f"{name}: (b) {b['records']} independent 16k-token records: "
                f"{b['records_per_s']:.0f} records/s (p50 {b['p50_ms']:.1f} ms)\n"
                f"{name}: (c) 20-turn session: {c['bytes_on_disk'] / 1e6:.2f} MB on disk, "
                f"{c['ratio_to_raw']:.2f}x the raw unique content "
                f"({c['raw_unique_bytes'] / 1e6:.2f} MB), "
                f"{c['ratio_to_full_prompt']:.3f}x full-prompt storage "
                f"({c['full_prompt_bytes'] / 1e6:.1f} MB)"
            )
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
