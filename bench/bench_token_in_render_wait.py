"""How much of a token-in call's added latency is the wait for its renders, against the real vLLM.

    .venv/bin/python bench/bench_token_in_render_wait.py --url http://127.0.0.1:PORT [--rounds 12]

Without ``--url`` it starts the tiny vLLM 0.32 CPU server (`scripts/tiny_vllm.py`, with
``--enable-scale-out``) and stops it at the end. The two-call agent session of
`bench_token_in_vllm.py` (about 4k prompt ids, greedy, ``max_tokens`` 8) is played through a
plain proxy and a token-in proxy, both in front of a loopback relay that timestamps every
request it passes to vLLM and the last byte of its answer. The second call is measured (bridged,
its turn close cached from the first round on). Per token-in call:

- ``before generate``: from the client's request to the generate request leaving the proxy (the
  renders, the bridge and the checks);
- ``plain render``: the request's own render (the largest render body), start to answer;
- ``dummies``: the last dummy render's answer, from the call's start;
- ``plain after dummies``: how long the plain render's answer came after the last dummy's (what
  the wait for the plain render adds if vLLM served renders side by side);
- ``dummies behind plain``: how long the dummies were in flight while the plain render was (what
  it adds at most, vLLM's frontend serving renders one after another). Between the two is what
  a whole-request check run beside generate could take off (generate's request is built from
  that render today, docs/token-in.md "Cost");
- ``after generate``: from generate's answer to the client's answer (derender, staging).

The plain call's latency through the same relay is printed beside it, and a third proxy's, with
``--token-in-beside on`` (generate sent once the dummies answer, beside the plain render): its
whole call, when its generate left, and how long before the request's own render answered it
left (negative: after; what a call that waits for that render cannot have). Unary calls only (a
stream's first byte waits for the same renders). Greedy, one call at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_token_in_vllm import Bench, _p, _proxy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from capture_proxy.testing.byte_relay import ByteRelay
from scripts import tiny_vllm

RENDER = "/v1/chat/completions/render"
GENERATE = "/inference/v1/generate"


async def measure(url: str, rounds: int, max_seconds: float) -> None:
    relay = ByteRelay(int(url.rsplit(":", 1)[1]))
    relay_url = f"http://127.0.0.1:{await relay.start()}"
    phases: dict[str, list[float]] = {
        k: []
        for k in (
            "whole",
            "before generate",
            "plain render",
            "dummies",
            "plain after dummies",
            "dummies behind plain",
            "generate",
            "after generate",
        )
    }
    plain_times: list[float] = []
    #: ``--token-in-beside on``: the whole call, and its (first) generate's start.
    beside: dict[str, list[float]] = {
        "whole": [],
        "before generate": [],
        "generate ahead of plain render": [],
        "generates": [],
    }
    targets = ("plain", "token-in", "beside")
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"vllm": url}
        runners = []
        for target in targets:
            (Path(tmp) / target).mkdir()
            runner, proxy = await _proxy(
                Path(tmp) / target, relay_url, target != "plain", beside=target == "beside"
            )
            runners.append(runner)
            urls[target] = proxy
        bench = Bench(url, urls, None)
        try:
            for r in range(rounds):
                for target in targets[r % 3 :] + targets[: r % 3]:
                    start: list[float] = []

                    def mark(start: list[float] = start) -> float:
                        # Called before the measured call and after it: the first is its start.
                        start.append(time.perf_counter())
                        return float(len(relay.log))

                    took, logged = await bench.session_call(target, f"{target}-{r}", False, mark)
                    if r == 0:
                        continue  # the close cache and vLLM's prefix cache warm up
                    if target == "plain":
                        plain_times.append(took)
                        continue
                    calls = relay.log[len(relay.log) - int(logged) :]
                    if target == "beside":
                        generates = [e for e in calls if e.path == GENERATE]
                        own = max((e for e in calls if e.path == RENDER), key=lambda e: e.size)
                        beside["whole"].append(took)
                        beside["before generate"].append(generates[0].sent - start[0])
                        # How long before the plain render's answer generate left (what the
                        # ordinary path waits for, its own work after the answer aside).
                        ahead = own.answered - generates[0].sent
                        beside["generate ahead of plain render"].append(ahead)
                        beside["generates"].append(len(generates))
                        continue
                    renders = [e for e in calls if e.path == RENDER]
                    [generate] = [e for e in calls if e.path == GENERATE]
                    t0, end = start[0], start[0] + took
                    plain = max(renders, key=lambda e: e.size)
                    dummies = [e for e in renders if e is not plain]
                    last_dummy = max((e.answered for e in dummies), default=t0)
                    phases["whole"].append(took)
                    phases["before generate"].append(generate.sent - t0)
                    phases["plain render"].append(plain.answered - plain.sent)
                    phases["dummies"].append(last_dummy - t0)
                    phases["plain after dummies"].append(max(0.0, plain.answered - last_dummy))
                    # vLLM's frontend renders one request after another: the dummies sent with
                    # the plain render wait behind it for at most this long.
                    first_dummy = min((e.sent for e in dummies), default=plain.answered)
                    behind = min(plain.answered, last_dummy) - max(first_dummy, plain.sent)
                    phases["dummies behind plain"].append(max(0.0, behind))
                    phases["generate"].append(generate.answered - generate.sent)
                    phases["after generate"].append(end - generate.answered)
                if time.monotonic() - began > max_seconds:
                    break
        finally:
            await bench.close()
            for runner in runners:
                await runner.cleanup()
            await relay.close()
    n = len(plain_times)
    print(f"{n} measured calls of each (unary, ~4k prompt ids, through the timing relay)")
    print()
    print("| what | p50 ms | mean ms |")
    print("|---|---|---|")
    print(
        f"| plain call | {_p(plain_times, 50) * 1000:.1f} | "
        f"{statistics.mean(plain_times) * 1000:.1f} |"
    )
    for name, values in phases.items():
        p50, mean = _p(values, 50) * 1000, statistics.mean(values) * 1000
        print(f"| token-in: {name} | {p50:.1f} | {mean:.1f} |")
    for name in ("whole", "before generate", "generate ahead of plain render"):
        p50, mean = _p(beside[name], 50) * 1000, statistics.mean(beside[name]) * 1000
        print(f"| beside: {name} | {p50:.1f} | {mean:.1f} |")
    added = _p(phases["whole"], 50) - _p(plain_times, 50)
    added_beside = _p(beside["whole"], 50) - _p(plain_times, 50)
    aborted = sum(1 for n in beside["generates"] if n > 1)
    low, high = (_p(phases[k], 50) for k in ("plain after dummies", "dummies behind plain"))
    print()
    print(
        f"- token-in adds {added * 1000:+.1f} ms p50 over the plain call; waiting for the plain "
        f"render before generate costs it {low * 1000:.1f}-{high * 1000:.1f} ms p50"
    )
    print(
        f"- with --token-in-beside on it adds {added_beside * 1000:+.1f} ms p50 "
        f"({aborted} of {len(beside['generates'])} generations aborted and sent again)"
    )


async def main(args: argparse.Namespace) -> None:
    proc = None
    url = args.url
    if url is None:
        port = tiny_vllm.free_port()
        proc = tiny_vllm.start(None, port, scale_out=True)
        url = f"http://127.0.0.1:{port}"
    try:
        await measure(url, args.rounds, args.max_seconds)
    finally:
        if proc is not None:
            tiny_vllm.stop(proc)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running tiny vLLM (loopback), else one is started")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-seconds", type=float, default=90.0)
    asyncio.run(main(parser.parse_args()))
