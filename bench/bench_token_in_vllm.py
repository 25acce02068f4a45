"""Token-in against the real vLLM: the plain call, the token-in call and vLLM itself, side by side.

    .venv/bin/python bench/bench_token_in_vllm.py [--rounds 12] [--max-seconds 100] [--bytes-only]
    .venv/bin/python bench/bench_token_in_vllm.py --url http://127.0.0.1:PORT --pid PID

Without ``--url`` it starts the tiny vLLM 0.32 CPU server (`scripts/tiny_vllm.py`, with
``--enable-scale-out``) on a free loopback port and stops it at the end; with ``--url`` it uses a
running one (``--pid``: its process, for the CPU figures). Three proxies run in this process, one
on the plain path and two with ``--token-in on`` (one with ``--token-in-beside on``), each with
its own SQLite store.

Each round plays, for each of the four targets (the plain proxy, the token-in proxy, the
token-in proxy with ``--token-in-beside on``, vLLM's own chat route) and unary then streamed, a
two-call session of an agent: a system prompt and tools (about 4k prompt ids with the tiny
model's tokenizer), a user message, the answer replayed, a second user message. The second call
is measured (the token-in one is bridged: its prompt is the first call's prompt + completion,
the turn close and the new message; the close and anchors are kept from the first round on, so
from then on the beside proxy sends its generate beside the request's own render): the client's
wall time (unary) or time to its first body byte (streamed), and the vLLM process's CPU time
during the call (`/proc`, in 10 ms ticks: the mean over the calls is reported; the engine runs
in that process).
Targets take turns within a round, so the shared machine's noise falls on each alike; the ratios
are what the figures are for. Greedy, ``max_tokens`` 8 (the tiny model answers noise; the
output's length is not what token-in adds to). ``--ending stop`` (the default) makes each
session's first answer end its turn at once on the end of sequence (a logit bias), as an agent's
turns end: a steady token-in call then reads its appended tokens from the request's own render
and makes no dummy render (docs/token-in.md, "A steady call without dummy renders");
``--ending length`` lets the tiny model's answer run to 8 tokens (eight newlines, which its
template renders as nothing: the dummy render is made). ``--tools short`` plays the session with
examples/rl_loop's one ``bash`` tool instead of the nine described tools.

Then the upstream bytes: the same session once more per target through a loopback relay that
counts the bytes each proxy sends vLLM for the second call (request lines, headers, bodies;
`capture_proxy.testing.byte_relay`), in all and per kind of request: the request's own render,
the bridge's dummy renders, generate, derender calls (unary, streamed). ``--bytes-only`` skips
the timed rounds; ``--dump DIR`` writes each measured request there; ``--bound`` sets the
token-in proxy's ``--token-in-upstream-bound`` (default 3).

Printed as markdown: per target and mode the p50 and p90 of the latency, the p50 of vLLM's CPU
per call, and the token-in call's added latency and CPU ratio over the plain call; then the
bytes. Each run is at most ``--max-seconds`` of measuring (rounds stop early past it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from procstat import cpu_seconds
from session_load import TOOLS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import examples.rl_loop.agent as rl_loop_agent
from capture_proxy.server.app import create_app
from capture_proxy.server.settings import Settings
from capture_proxy.sinks import open_sink
from capture_proxy.testing.byte_relay import ByteRelay, by_kind
from scripts import tiny_vllm

_SENTENCE = "You are a coding agent working in a repository; use the tools, keep answers short. "
#: About 4k prompt ids with the tools, with the tiny model's 4k-vocabulary tokenizer.
SYSTEM = {"role": "system", "content": _SENTENCE * 40}
TARGETS = ("plain", "token-in", "beside", "vllm")
#: The token-in targets: ``beside`` is the token-in proxy with ``--token-in-beside on``.
TOKEN_IN = ("token-in", "beside")


def _first_body(stream: bool) -> dict[str, Any]:
    return {
        "model": tiny_vllm.SERVED_MODEL_NAME,
        "messages": [SYSTEM, {"role": "user", "content": "List the files."}],
        "tools": TOOL_SETS[SHAPE[0]],
        "temperature": 0,
        "max_tokens": 8,
        **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}),
        **({"logit_bias": {str(END[0]): 100}} if END[0] is not None else {}),
    }


def _replayed(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as an agent sends it back."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning"):
        out["reasoning"] = message["reasoning"]
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def _streamed_message(data: bytes) -> dict[str, Any]:
    content, reasoning = [], []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:])["choices"]:
                content.append(choice["delta"].get("content") or "")
                reasoning.append(choice["delta"].get("reasoning") or "")
    return {"content": "".join(content), "reasoning": "".join(reasoning)}


#: ``--token-in-upstream-bound`` of the token-in proxy (``--bound``).
BOUND = [3.0]
#: The session's tools (``--tools``): nine described ones (session_load's), or one with a short
#: description (examples/rl_loop's ``bash``), whose prompt ids are more of its bytes.
TOOL_SETS: dict[str, list[dict[str, Any]]] = {
    "nine": TOOLS,
    "short": rl_loop_agent.TOOLS,
}
SHAPE = ["nine"]
#: With ``--ending stop``: the end-of-sequence id each session's first answer is made to stop on
#: at once (a logit bias), as an agent's turns end; else the tiny model's answer is cut at 8.
END: list[int | None] = [None]


async def _proxy(
    workdir: Path, upstream: str, token_in: bool, *, beside: bool = False
) -> tuple[web.AppRunner, str]:
    store = f"sqlite:///{workdir / 'store.db'}"
    settings = Settings(
        upstream=upstream,
        store=store,
        token_in="on" if token_in else "off",
        token_in_upstream_bound=BOUND[0],
        token_in_beside="on" if beside else "off",
    )
    runner = web.AppRunner(create_app(settings, sink=open_sink(store)))
    await runner.setup()
    port = tiny_vllm.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


class Bench:
    def __init__(self, vllm: str, urls: dict[str, str], pid: int | None) -> None:
        self.vllm = vllm
        self.urls = urls
        self.pid = pid
        self.session = aiohttp.ClientSession()
        #: (target, mode) -> latencies (s) and vLLM CPU seconds of the measured calls.
        self.latency: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        self.cpu: dict[tuple[str, str], list[float]] = collections.defaultdict(list)

    async def call(self, target: str, rollout: str, body: dict[str, Any]) -> tuple[Any, float]:
        """The answer's message and the latency (unary: whole; streamed: first body byte)."""
        base = self.urls[target]
        headers = {"X-Rollout-Id": rollout} if target != "vllm" else {}
        start = time.perf_counter()
        async with self.session.post(
            f"{base}/v1/chat/completions", json=body, headers=headers
        ) as resp:
            if not body.get("stream"):
                raw = await resp.read()
                took = time.perf_counter() - start
                assert resp.status == 200, raw[:300]
                return orjson.loads(raw)["choices"][0]["message"], took
            first = await resp.content.readany()
            took = time.perf_counter() - start
            rest = await resp.read()
            assert resp.status == 200, (first + rest)[:300]
            return _streamed_message(first + rest), took

    async def session_call(
        self, target: str, rollout: str, stream: bool, around: Callable[[], float]
    ) -> tuple[float, float]:
        """Play the two calls; the second's latency and what `around` measured over it."""
        first = _first_body(stream)
        message, _ = await self.call(target, rollout, first)
        second = {
            **first,
            "messages": [
                *first["messages"],
                _replayed(message),
                {"role": "user", "content": "Go on."},
            ],
        }
        before = around()
        _, took = await self.call(target, rollout, second)
        return took, around() - before

    def cpu_now(self) -> float:
        return cpu_seconds(self.pid) if self.pid is not None else 0.0

    async def rounds(self, rounds: int, max_seconds: float) -> None:
        began = time.monotonic()
        for r in range(rounds):
            for stream in (False, True):
                mode = "streamed" if stream else "unary"
                order = TARGETS[r % len(TARGETS) :] + TARGETS[: r % len(TARGETS)]
                for target in order:
                    took, cpu = await self.session_call(
                        target, f"{target}-{mode}-{r}", stream, self.cpu_now
                    )
                    if r > 0:  # round 0 warms up (the close cache, vLLM's prefix cache)
                        self.latency[target, mode].append(took)
                        self.cpu[target, mode].append(cpu)
            if time.monotonic() - began > max_seconds:
                break

    def report(self) -> None:
        print("| target | mode | calls | p50 ms | p90 ms | vLLM CPU mean ms |")
        print("|---|---|---|---|---|---|")
        for (target, mode), times in sorted(self.latency.items()):
            cpu = self.cpu[target, mode]
            print(
                f"| {target} | {mode} | {len(times)} | {_ms(_p(times, 50))} | "
                f"{_ms(_p(times, 90))} | {_ms(statistics.mean(cpu))} |"
            )
        print()
        for mode in ("unary", "streamed"):
            plain = self.latency["plain", mode]
            over_vllm = _p(plain, 50) - _p(self.latency["vllm", mode], 50)
            for target in TOKEN_IN:
                if not self.latency[target, mode]:
                    continue
                added = _p(self.latency[target, mode], 50) - _p(plain, 50)
                cpu_ratio = statistics.mean(self.cpu[target, mode]) / max(
                    statistics.mean(self.cpu["plain", mode]), 1e-9
                )
                print(
                    f"- {mode}: {target} adds {added * 1000:+.1f} ms p50 over the plain call "
                    f"(which adds {over_vllm * 1000:+.1f} ms over vLLM); vLLM CPU per call "
                    f"{cpu_ratio:.2f}x the plain call's"
                )

    async def close(self) -> None:
        await self.session.close()


def _p(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, (len(ordered) * q) // 100)]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


async def _bytes(vllm: str, port: int, workdir: Path, dump: Path | None) -> None:
    """The second call's upstream bytes per proxy, through the counting relay: in all, and per
    kind of request (`request_kind`: count, bytes of heads, bytes of bodies)."""
    relay = ByteRelay(port)
    relay_url = f"http://127.0.0.1:{await relay.start()}"
    runners = []
    urls = {"vllm": vllm}
    for target in ("plain", *TOKEN_IN):
        runner, url = await _proxy(
            workdir / f"bytes-{target}", relay_url, target != "plain", beside=target == "beside"
        )
        runners.append(runner)
        urls[target] = url
    bench = Bench(vllm, urls, None)
    marks: list[int] = []

    def around() -> float:
        marks.append(len(relay.log))
        return float(sum(s.size for s in relay.log))

    rows: list[tuple[str, str, int, dict[str, tuple[int, int, int]]]] = []
    try:
        for stream in (False, True):
            mode = "streamed" if stream else "unary"
            for target in ("plain", *TOKEN_IN):
                # The first session learns the close and anchors; the second is measured (with
                # --token-in-beside, its second call goes beside its render).
                for r in range(2):
                    _, got = await bench.session_call(
                        target, f"bytes-{target}-{mode}-{r}", stream, around
                    )
                measured = relay.log[marks[-2] : marks[-1]]
                if dump is not None:
                    for i, sent in enumerate(measured):
                        name = f"{target}-{mode}-{i:03d}{sent.path.replace('/', '_')}"
                        (dump / name).write_bytes(sent.head + sent.body)
                rows.append((target, mode, int(got), by_kind(measured, 4)))
    finally:
        await bench.close()
        for runner in runners:
            await runner.cleanup()
        await relay.close()
    print()
    print("| target | mode | bytes sent upstream (2nd call) | ratio to plain |")
    print("|---|---|--:|--:|")
    plain = {mode: size for target, mode, size, _ in rows if target == "plain"}
    for target, mode, size, _ in rows:
        print(f"| {target} | {mode} | {size:,} | {size / plain[mode]:.3f} |")
    print()
    print("| target | mode | request kind | requests | head bytes | body bytes | / plain call |")
    print("|---|---|---|--:|--:|--:|--:|")
    for target, mode, _, kinds in rows:
        for name, (n, heads, bodies) in sorted(kinds.items()):
            share = (heads + bodies) / plain[mode]
            print(f"| {target} | {mode} | {name} | {n} | {heads:,} | {bodies:,} | {share:.2f} |")


async def main(args: argparse.Namespace) -> None:
    BOUND[0] = args.bound
    SHAPE[0] = args.tools
    proc = None
    pid = args.pid
    url = args.url
    if url is None:
        port = tiny_vllm.free_port()
        proc = tiny_vllm.start(None, port, scale_out=True)
        url, pid = f"http://127.0.0.1:{port}", proc.pid
    try:
        if args.ending == "stop":
            END[0] = tiny_vllm.end_of_sequence(int(url.rsplit(":", 1)[1]))
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            runners = []
            urls = {"vllm": url}
            for target in ("plain", *TOKEN_IN):
                (workdir / target).mkdir()
                runner, proxy_url = await _proxy(
                    workdir / target, url, target != "plain", beside=target == "beside"
                )
                runners.append(runner)
                urls[target] = proxy_url
            bench = Bench(url, urls, pid)
            try:
                if not args.bytes_only:
                    await bench.rounds(args.rounds, args.max_seconds)
                    bench.report()
            finally:
                await bench.close()
                for runner in runners:
                    await runner.cleanup()
            for target in ("plain", *TOKEN_IN):
                (workdir / f"bytes-{target}").mkdir()
            await _bytes(url, int(url.rsplit(":", 1)[1]), workdir, args.dump)
    finally:
        if proc is not None:
            tiny_vllm.stop(proc)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running tiny vLLM (loopback), else one is started")
    parser.add_argument("--pid", type=int, help="its process id, for the CPU figures")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-seconds", type=float, default=100.0)
    parser.add_argument("--bytes-only", action="store_true", help="only the upstream bytes")
    parser.add_argument("--bound", type=float, default=3.0, help="--token-in-upstream-bound")
    parser.add_argument(
        "--tools", choices=sorted(TOOL_SETS), default="nine", help="the session's tools"
    )
    parser.add_argument(
        "--ending",
        choices=("length", "stop"),
        default="stop",
        help="the first answer of each session: cut at 8 tokens, or ended on the end of sequence",
    )
    parser.add_argument("--dump", type=Path, help="write each measured upstream request there")
    asyncio.run(main(parser.parse_args()))
