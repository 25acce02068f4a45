"""CPU per stage of one captured call, in-process (no HTTP): where capture's milliseconds go.

    .venv/bin/python bench/stages.py [--rounds 200]

Runs the workload's session turns (`workload.build_workload`) through the same steps the proxy's
request path takes, and reports the median CPU time (``time.thread_time``, so other processes on
a shared machine do not inflate it) of each step per call: decoding and normalizing the request,
planning the forwarded body, parsing vLLM's answer (non-streamed and streamed), building and
sealing the record, and encoding it for the store (what the SQLite writer thread does before
its INSERT). Calls go through one rollout turn after turn, as an agent session does, so lineage
and the adapter's prefix cache see what they see in production.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
from workload import TURNS, build_workload, tag_request

from capture_proxy.adapters.vllm import VLLMAdapter
from capture_proxy.core.capture import Capture, sampling_of
from capture_proxy.core.normalize import normalize_request
from capture_proxy.schemas.tokens import full_sequence
from capture_proxy.sinks.codec import encode_record
from capture_proxy.sinks.memory import MemorySink


class Clock:
    """CPU time of named steps, one sample per call."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.thread_time()
        yield
        self.samples.setdefault(name, []).append(time.thread_time() - t)


async def run(rounds: int) -> dict[str, float]:
    w = build_workload()
    adapter = VLLMAdapter()
    capture = Capture(MemorySink())
    clock = Clock()
    fulls: dict[str, array[int]] = {}
    for i in range(rounds):
        turn = i % TURNS
        rollout = f"r{i // TURNS}"
        stream = i % 2 == 1
        raw = tag_request(w.stream_request if stream else w.request, turn, i)
        with clock("request: decode JSON"):
            data = orjson.loads(raw)
        with clock("request: normalize + validate"):
            norm = normalize_request(data)
        await capture.ensure_rollout(rollout)
        with clock("request: admit (request key)"):
            call = capture.begin_call(rollout, norm.staged, norm.attachments)
        with clock("request: plan forwarded body"):
            plan = adapter.plan(norm.body)
        if stream:
            with clock("answer: stream relay + accumulate (1k chunks)"):
                acc = adapter.stream(plan, session=rollout)
                for event in w.streams[turn]:
                    acc.feed(event)
                completion = acc.finish()
        else:
            with clock("answer: parse + client body"):
                completion, _ = adapter.parse_response(w.answers[turn], plan, session=rollout)
        with clock("record: build + validate + seal (digests)"):
            record = capture.build_record(
                call,
                completion,
                model="policy",
                upstream_version="0.32.0",
                tokenizer_fingerprint="sha256:x",
                sampling=sampling_of(norm.body),
            )
        parent = fulls.get(record.parent_call_id) if record.parent_call_id else None
        with clock("store: encode record (writer thread)"):
            encode_record(record, parent)
        await capture.complete_call(call, completion, model="policy")
        # What the sink's cache of committed sequences holds for the next call's delta.
        fulls[call.call_id] = full_sequence(
            completion.prompt_token_ids, completion.completion_token_ids
        )
    # The first session's turns warm caches up: leave them out.
    return {k: 1000 * statistics.median(v[TURNS:]) for k, v in clock.samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=160)
    args = p.parse_args()
    medians = asyncio.run(run(args.rounds))
    width = max(map(len, medians))
    for name, ms in medians.items():
        print(f"{name:<{width}}  {ms:7.3f} ms")


if __name__ == "__main__":
    main()
