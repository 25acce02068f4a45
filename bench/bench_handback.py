"""A rollout handed between two proxies on one object-store dataset: what each hand costs a call.

    .venv/bin/python bench/bench_handback.py [--rollouts 100] [--calls 3] [--json]

On moto's S3 server (a subprocess on 127.0.0.1), two proxies (in this process, each with its
own fake vLLM, as the tests run them) share one ``s3://`` dataset. Proxy A first stages
`--rollouts` rollouts of `--calls` calls each (a store of a few hundred units), then one rollout
goes A -> B -> A. Timed, per call, as its client sees it (median of `--repeat` hand-offs):

1. steady: a call of a rollout its proxy holds;
2. hand-off: B's first call of a rollout A held (read back from the store: ``--rollout-resume
   -timeout`` bounds this);
3. hand-back: A's next call of it while A still holds its old state (the claim refused, the
   rollout read again, the call staged at the next free seq: `core/handback.py`).

One run on a shared machine: compare the three, not the absolute numbers between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support: moto's server, the in-process proxies

from capture_proxy.sinks.registry import open_sink  # noqa: E402
from tests.support.proxy_harness import (  # noqa: E402
    Proxy,
    chat_body,
    start_proxy,
    stop_proxy,
    user,
)
from tests.support.s3 import MotoS3  # noqa: E402


async def _call(proxy: Proxy, rollout: str, history: list[dict[str, Any]]) -> float:
    history.append(user(f"turn {len(history)}"))
    started = time.perf_counter()
    resp = await proxy.chat(chat_body(*history), rollout=rollout)
    body = await resp.json()
    took = time.perf_counter() - started
    status = resp.headers.get("X-Capture-Status")
    if status != "staged":
        raise SystemExit(f"{rollout}: {resp.status} {status}: {body}")
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return took


async def _run(rollouts: int, calls: int, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, MotoS3(Path(tmp) / "moto") as moto:
        old = moto.apply_env()
        url = moto.url()
        a = await start_proxy(Path(tmp) / "a", sink=open_sink(url), store=url)
        b = await start_proxy(Path(tmp) / "b", sink=open_sink(url), store=url)
        try:
            filled = time.perf_counter()
            for i in range(rollouts):
                history: list[dict[str, Any]] = []
                for _ in range(calls):
                    await _call(a, f"fill-{i}", history)
            fill_s = time.perf_counter() - filled
            steady, handoff, handback = [], [], []
            for n in range(repeat):
                history = []
                rollout = f"moved-{n}"
                for _ in range(3):
                    steady.append(await _call(a, rollout, history))
                handoff.append(await _call(b, rollout, history))
                await _call(b, rollout, history)
                handback.append(await _call(a, rollout, history))
            moves = a.state.capture.handback.moves
        finally:
            await stop_proxy(a)
            await stop_proxy(b)
            MotoS3.restore_env(old)
    return {
        "rollouts": rollouts,
        "calls_per_rollout": calls,
        "fill_s": round(fill_s, 1),
        "steady_ms": round(1000 * statistics.median(steady), 1),
        "handoff_ms": round(1000 * statistics.median(handoff), 1),
        "handback_ms": round(1000 * statistics.median(handback), 1),
        "handback_max_ms": round(1000 * max(handback), 1),
        "moved_calls": moves,
        "repeat": repeat,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=100)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(_run(args.rollouts, args.calls, args.repeat))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>18}: {value}")


if __name__ == "__main__":
    main()
