"""Storage size and read speed of one OpenCode-like session, in SQLite and Parquet.

    .venv/bin/python bench/bench_parquet.py [--turns 30] [--passes 7] [--sinks sqlite,parquet]
                                            [--json]

The session: OpenCode's title call (no tools), then `turns` agent calls. The first agent prompt is
a 10k-token system prompt + tool definitions and the user's task; every turn generates 1,024
tokens with logprobs (reasoning and a tool call), and the next prompt re-sends the whole history
plus the tool's output (~300 tokens). Token ids follow a log-uniform distribution over a 150k
vocabulary (frequent tokens have small ids, as with BPE); the text is English-like words.

Reported, per sink:

* bytes on disk after the session (Parquet also after `compact_store`), against the session's
  raw unique content (4 bytes a token of the final sequence, 4 bytes a generated logprob, the
  conversation's text once) and against storing every call's full prompt;
* staging: calls/s and p50 `stage` latency for the session, one call at a time (each call is its
  own durable commit, as in a live session);
* reading: calls/s and MB/s of token data (4 bytes per prompt id, completion id and logprob of
  every call) through `Store.fetch`, which verifies every digest: cold (a new reader per pass,
  files read and decoded) and warm (the same reader again); and how the cold time splits between
  the sink's decode and digest verification. Parquet is read after compaction, and cold also
  before it (one small unit per call, as a live proxy leaves it);
* trajectory rebuild: `Store.trajectory` on a new reader.

Times are the median of `passes` runs on one core; the machine is shared, so expect noise.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
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

from capture_proxy.read.reader import Store
from capture_proxy.schemas.digest import seal_record, verify_record
from capture_proxy.schemas.records import CallStatus, StagedCallRecord
from capture_proxy.sinks.base import StagingSink, StagingSource
from capture_proxy.sinks.parquet import compact_store

SYSTEM_TOKENS = 8_000
TOOLS_TOKENS = 2_000
COMPLETION_TOKENS = 1_024
TOOL_OUTPUT_TOKENS = 300
TEMPLATE_TOKENS = 12  # role markers and the like, per message
VOCAB = 150_000
BYTES_PER_TOKEN = 4  # of text, roughly what BPE gives on English and code
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
    "function",
    "return",
    "value",
    "file",
    "test",
    "error",
    "import",
    "class",
    "def",
    "self",
    "data",
    "path",
    "line",
    "output",
    "result",
    "should",
]


def _ids(rng: random.Random, n: int) -> array[int]:
    # Log-uniform over the vocabulary: small (frequent) ids dominate, as in real BPE output.
    return array("i", [int(math.exp(rng.random() * math.log(VOCAB))) - 1 for _ in range(n)])


def _text(rng: random.Random, tokens: int) -> str:
    out: list[str] = []
    size = 0
    while size < tokens * BYTES_PER_TOKEN:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


class OpenCodeSession:
    """Builds the sealed records of one session, call after call."""

    def __init__(self, rollout_id: str = "bench", seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.rollout_id = rollout_id
        rng = self.rng
        self.tools = [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": _text(rng, TOOLS_TOKENS // 10 - 30),
                    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
                },
            }
            for i in range(10)
        ]
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": _text(rng, SYSTEM_TOKENS)},
            {"role": "user", "content": "The test suite fails on CI; find out why and fix it."},
        ]
        self.full = _ids(rng, SYSTEM_TOKENS + TOOLS_TOKENS + 40)
        self.seq = 0
        self.parent: str | None = None

    def _record(
        self,
        call_id: str,
        request: dict[str, Any],
        prompt: array[int],
        n_out: int,
        response: dict[str, Any],
        parent: str | None,
    ) -> StagedCallRecord:
        rng = self.rng
        record = StagedCallRecord(
            rollout_id=self.rollout_id,
            call_id=call_id,
            seq=self.seq,
            model="policy",
            finish_reason="tool_calls" if response.get("tool_calls") else "stop",
            request=request,
            response=response,
            prompt_token_ids=prompt,
            completion_token_ids=_ids(rng, n_out),
            completion_logprobs=array("f", [-rng.expovariate(3.0) for _ in range(n_out)]),
            parent_call_id=parent,
            upstream_version="0.32.0",
            tokenizer_fingerprint="sha256:" + "ab" * 32,
            sampling={"temperature": 1.0, "max_tokens": 32000},
        )
        self.seq += 1
        return seal_record(record)

    def title(self) -> StagedCallRecord:
        request = {
            "model": "policy",
            "messages": [
                {"role": "system", "content": "Generate a short title for the conversation."},
                self.messages[1],
            ],
            "reasoning_effort": "low",
        }
        prompt = _ids(self.rng, 60)
        return self._record(
            "bench-title", request, prompt, 12, {"role": "assistant", "content": "Fix CI"}, None
        )

    def turn(self) -> StagedCallRecord:
        rng = self.rng
        request = {
            "model": "policy",
            "messages": list(self.messages),
            "tools": self.tools,
            "tool_choice": "auto",
            "stream": True,
        }
        call_id = f"bench-c{self.seq}"
        response = {
            "role": "assistant",
            "content": "",
            "reasoning_content": _text(rng, COMPLETION_TOKENS - 60),
            "tool_calls": [
                {
                    "id": f"call_{self.seq}",
                    "type": "function",
                    "function": {
                        "name": "tool_0",
                        "arguments": json.dumps({"command": _text(rng, 40)}),
                    },
                }
            ],
        }
        record = self._record(call_id, request, self.full, COMPLETION_TOKENS, response, self.parent)
        tool_output = {
            "role": "tool",
            "tool_call_id": f"call_{self.seq - 1}",
            "content": _text(rng, TOOL_OUTPUT_TOKENS),
        }
        self.messages = [*self.messages, response, tool_output]
        full = array("i", record.prompt_token_ids)
        full.extend(record.completion_token_ids)
        full.extend(_ids(rng, TOOL_OUTPUT_TOKENS + 2 * TEMPLATE_TOKENS))
        self.full = full
        self.parent = call_id
        return record


def build(turns: int) -> list[StagedCallRecord]:
    s = OpenCodeSession()
    return [s.title(), *(s.turn() for _ in range(turns))]


def sizes(records: list[StagedCallRecord]) -> dict[str, int]:
    """Raw unique content and full-prompt storage of the session, in bytes."""
    last = records[-1]
    unique_tokens = last.cum_len + records[0].cum_len  # the title call is its own sequence
    generated = sum(len(r.completion_logprobs) for r in records)
    seen: set[bytes] = set()
    text = 0
    for r in records:
        rest = {k: v for k, v in r.request.items() if k != "messages"}
        for part in (*r.request["messages"], r.response, rest):
            b = orjson.dumps(part, option=orjson.OPT_SORT_KEYS)
            if b not in seen:
                seen.add(b)
                text += len(b)
    full_prompt = sum(
        4 * r.cum_len
        + 4 * len(r.completion_logprobs)
        + len(orjson.dumps(dict(r.request)))
        + len(orjson.dumps(dict(r.response)))
        for r in records
    )
    return {"raw": 4 * unique_tokens + 4 * generated + text, "full_prompt": full_prompt}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def _stage(sink: StagingSink, records: list[StagedCallRecord]) -> list[float]:
    latencies = []
    for r in records:
        t = time.perf_counter()
        res = await sink.stage(r)
        latencies.append(time.perf_counter() - t)
        if res.status is not CallStatus.STAGED:
            raise RuntimeError(f"{r.call_id}: {res}")
    await sink.close()
    return latencies


def _median_time(fn: Callable[[], Any], passes: int) -> float:
    times = []
    for _ in range(passes):
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_sink(
    kind: str, where: Path, records: list[StagedCallRecord], passes: int
) -> dict[str, Any]:
    if kind == "sqlite":
        from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource

        location = str(where / "bench.db")
        sink: StagingSink = SQLiteSink(location)

        def source() -> StagingSource:
            return SQLiteSource(location)
    else:
        from capture_proxy.sinks.parquet import ParquetSink, ParquetSource

        location = str(where / "dataset")
        sink = ParquetSink(location)

        def source() -> StagingSource:
            return ParquetSource(location)

    latencies = asyncio.run(_stage(sink, records))
    out: dict[str, Any] = {
        "stage_calls_per_s": len(records) / sum(latencies),
        "stage_p50_ms": 1000 * statistics.median(latencies),
        "bytes_on_disk": _dir_bytes(where),
    }
    keys = [r.call_id for r in records]
    token_bytes = sum(4 * (r.cum_len + len(r.completion_logprobs)) for r in records)

    def cold() -> None:
        with Store(source()) as s:
            s.fetch(keys)

    if kind == "parquet":
        # Reading the live dataset (one small unit per call), then compacting it.
        out["cold_uncompacted_MB_per_s"] = token_bytes / _median_time(cold, passes) / 1e6
        stats = compact_store(location, grace_s=0)
        out["units"] = stats.units_before
        out["bytes_compacted"] = _dir_bytes(where)

    warm_store = Store(source())
    warm_store.fetch(keys)
    fetched: list[StagedCallRecord] = []

    def decode_only() -> None:
        src = source()
        fetched[:] = src.fetch(keys)
        src.close_reader()

    def verify_only() -> None:
        for r in fetched:
            verify_record(r)

    t_cold = _median_time(cold, passes)
    t_warm = _median_time(lambda: warm_store.fetch(keys), passes)
    t_decode = _median_time(decode_only, passes)
    t_verify = _median_time(verify_only, passes)
    t_traj = _median_time(
        lambda: Store(source()).trajectory(records[0].rollout_id, include_open=True), passes
    )
    traj = warm_store.trajectory(records[0].rollout_id, include_open=True)
    warm_store.close()
    out.update(
        {
            "token_bytes": token_bytes,
            "cold_calls_per_s": len(keys) / t_cold,
            "cold_MB_per_s": token_bytes / t_cold / 1e6,
            "warm_calls_per_s": len(keys) / t_warm,
            "warm_MB_per_s": token_bytes / t_warm / 1e6,
            "decode_ms": 1000 * t_decode,
            "verify_ms": 1000 * t_verify,
            "trajectory_ms": 1000 * t_traj,
            "trajectory_tokens": len(traj.token_ids),
            "trajectory_segments": len(traj.segments),
        }
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--sinks", default="sqlite,parquet")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    print(
        f"# {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}; "
        f"{' '.join(sys.argv[1:]) or '(defaults)'}"
    )
    records = build(args.turns)
    sz = sizes(records)
    print(
        f"session: {len(records)} calls (title + {args.turns} turns), final sequence "
        f"{records[-1].cum_len} tokens; raw unique content {sz['raw'] / 1e6:.2f} MB, "
        f"full-prompt storage {sz['full_prompt'] / 1e6:.1f} MB "
        f"({sz['full_prompt'] / sz['raw']:.1f}x raw)"
    )
    results: dict[str, Any] = {"raw_bytes": sz["raw"], "full_prompt_bytes": sz["full_prompt"]}
    base = Path(tempfile.mkdtemp(prefix="bench-parquet-"))
    try:
        for kind in args.sinks.split(","):
            try:
                r = bench_sink(kind, base / kind, records, args.passes)
            except ImportError as e:
                print(f"{kind}: skipped ({e})")
                continue
            results[kind] = r
            size = f"{r['bytes_on_disk'] / 1e6:.2f} MB = {r['bytes_on_disk'] / sz['raw']:.2f}x raw"
            if "bytes_compacted" in r:
                size += (
                    f" in {r['units']} units; compacted {r['bytes_compacted'] / 1e6:.2f} MB = "
                    f"{r['bytes_compacted'] / sz['raw']:.2f}x raw"
                )
            if "cold_uncompacted_MB_per_s" in r:
                print(
                    f"{kind}: fetch+verify cold, before compaction "
                    f"{r['cold_uncompacted_MB_per_s']:.0f} MB/s of token data"
                )
            print(
                f"{kind}: on disk {size}\n"
                f"{kind}: staging {r['stage_calls_per_s']:.0f} calls/s, "
                f"p50 {r['stage_p50_ms']:.1f} ms\n"
                f"{kind}: fetch+verify cold {r['cold_calls_per_s']:.0f} calls/s = "
                f"{r['cold_MB_per_s']:.0f} MB/s of token data; warm {r['warm_calls_per_s']:.0f} "
                f"calls/s = {r['warm_MB_per_s']:.0f} MB/s (cold: decode {r['decode_ms']:.1f} ms "
                f"+ verify {r['verify_ms']:.1f} ms for {r['token_bytes'] / 1e6:.1f} MB)\n"
                f"{kind}: trajectory rebuild {r['trajectory_ms']:.1f} ms "
                f"({r['trajectory_tokens']} tokens, {r['trajectory_segments']} segment(s))"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
