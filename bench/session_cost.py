"""CPU per call of the record's digest and storage encoding as an agent session grows.

    .venv/bin/python bench/session_cost.py [--turns 150] [--json]

Builds one long agent session (`bench_staging.Session`: a 16k-token context, ~2k tokens and two
messages more per turn) and, call after call, does what the proxy does with each record on its
way to the store, timing each step's CPU (``time.thread_time``): ``seal``, the record digest as
`core.capture.Capture` computes it (with the per-rollout message memo where the checkout has one),
and ``encode``, the row encoding a sink's writer thread does (`sinks.codec.encode_record`). Each
call's request is decoded afresh from JSON, as the proxy sees it. Prints the median per call over
the first and the last quarter of the session, so the growth with the session shows; run it from
two checkouts (``cd ../base && .venv/bin/python ../head/bench/session_cost.py``) to compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson
from bench_staging import Session

from capture_proxy.schemas.digest import RequestValueCache, seal_record
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.sinks.codec import encode_record


def _sealer() -> Callable[[StagedCallRecord], StagedCallRecord]:
    values = RequestValueCache()
    try:
        from capture_proxy.schemas.message_memo import MessageMemo, rollout_digester
    except ImportError:  # a checkout from before the memo
        return lambda r: seal_record(r, encoder=values)
    memo: MessageMemo[bytes] = MessageMemo()
    return lambda r: seal_record(r, encoder=values, digester=rollout_digester(memo, r.rollout_id))


def run(turns: int) -> dict[str, Any]:
    session = Session("bench-session", 7)
    seal = _sealer()
    times: dict[str, list[float]] = {"seal": [], "encode": []}
    for _ in range(turns):
        built = session.next()
        record = dataclasses.replace(built, request=orjson.loads(orjson.dumps(built.request)))
        t = time.thread_time()
        sealed = seal(record)
        times["seal"].append(time.thread_time() - t)
        if sealed.digest != built.digest:
            raise RuntimeError(f"{built.call_id}: the digest changed")
        t = time.thread_time()
        encode_record(sealed, None)
        times["encode"].append(time.thread_time() - t)
    q = max(1, turns // 4)
    out: dict[str, Any] = {"turns": turns}
    for step, v in times.items():
        out[f"{step} first quarter"] = 1000 * statistics.median(v[:q])
        out[f"{step} last quarter"] = 1000 * statistics.median(v[-q:])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=150)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = p.parse_args()
    figures = run(args.turns)
    if args.json:
        print(json.dumps(figures))
        return
    for name, value in figures.items():
        print(f"{name:<22} {value:8.3f}" if name != "turns" else f"turns {value}")


if __name__ == "__main__":
    main()
