"""What each upstream request of a token-in call and of a plain captured call costs the upstream.

    .venv/bin/python bench/bench_upstream_routes.py --fake [--repeat 20] [--max-seconds 90]
    .venv/bin/python bench/bench_upstream_routes.py --url http://127.0.0.1:PORT [--repeat 20]

`--fake` starts the bundled fake vLLM (`fake_upstream.py`, the token-in benchmark's upstream) on
a free loopback port and stops it at the end; `--url` names an upstream already running on
loopback, such as a real vLLM started with ``--enable-scale-out`` (``scripts/tiny_vllm.py serve
--port P --enable-scale-out``: the tiny CPU model and its Qwen3-style template). Only loopback
URLs are accepted.

The conversations are those of `bench_proxy.py`'s token-in scenarios (`session_load.py`'s
system prompt, tools and replayed messages; the assistant turns are the `bash` tool calls with
reasoning that `fake_upstream.py` answers, so both upstreams get the same requests). For the
session's 2nd, 3rd and 4th calls it builds, with the proxy's own code, the requests each route
gets (temperature 0, `--max-tokens` as the output limit):

- ``chat``: the plain captured call, ``POST /v1/chat/completions`` with what capture adds
  (``return_token_ids``, ``logprobs``, ``top_logprobs``: `VLLMAdapter.plan`);
- ``render``: the render of that request (``POST /v1/chat/completions/render``), as token-in
  sends it (the same body without ``stream``);
- ``close-A`` ... ``suffix-B``: the renders of the bridge's dummy conversations, from
  `capture_proxy.core.token_in.plan` on the real request (the close pair is cached per template
  by the proxy, so a bridged call after a tool-call answer sends the turn and suffix pairs);
- ``lean-turn``, ``lean-suffix``: what the proxy sends instead once a template's anchors are
  known: the first dummy of each pair, lean (without the system message and tools:
  ``plan(..., lean=True)``; docs/token-in.md, "Lean dummies");
- ``render-tiny``: a render of one short user message without tools, for comparison: what the
  route costs apart from the size of the conversation (not a request the proxy sends);
- ``generate``: ``POST /inference/v1/generate`` with the plain render's answer, as the proxy
  sends it: vLLM 0.32's render omits a ``max_tokens`` equal to SamplingParams' default (16),
  which generate would read as unset, so it is said (`Rendered.generate_body`), and generate
  samples as many tokens as chat;
- ``derender``: ``POST /v1/chat/completions/derender`` of generate's answer with the prompt ids
  and the chat request (`derender_body`).

Each request is built once, then the routes are timed one request at a time, in turn, on one
keep-alive connection: `--warmup` untimed rounds, then up to `--repeat` timed rounds, fewer if
`--max-seconds` run out. Times are the client's wall time from sending the request to the last
byte of the answer. Printed as markdown: per call and route the p50 and p90, the body sizes and
the prompt length; then per call "token-in's upstream time", the sum in each round of what a
bridged call sends one after another (the plain render, the dummy renders, generate, derender),
against the plain call's chat, as a difference and a ratio of their p50s, and the part of it
that is frontend work only (the renders and derender: no model step). The proxy sends the
renders at once, so this sum is the upstream's work, not necessarily the wall time it adds:
the route table's last rows per call time those renders sent together (one connection each),
whole pairs and lean single renders, which is what they add to a bridged call's latency.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from fake_upstream import REASONING
from session_load import SYSTEM, TOOL_OUTPUT, TOOLS, _replayed

from capture_proxy.adapters.vllm import VLLMAdapter, derender_body, read_generate, read_render
from capture_proxy.core.normalize import normalize_request
from capture_proxy.core.token_in import Extension, Prior, match, plan

RENDER = "/v1/chat/completions/render"
GENERATE = "/inference/v1/generate"
DERENDER = "/v1/chat/completions/derender"
CHAT = "/v1/chat/completions"
#: The session's calls measured (1-based): each extends the previous one and is bridged.
CALLS = (2, 3, 4)
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass
class Route:
    """One request to time: its path, body, and the times measured."""

    name: str
    path: str
    body: bytes
    times: list[float] = field(default_factory=list)


@dataclass
class Shape:
    """The requests of one call of the session."""

    call: int
    routes: dict[str, Route]
    #: Per set of `AT_ONCE`: the seconds until every render of a bridged call after a tool-call
    #: answer was answered, sent at once as the proxy sends them (each on its own connection).
    at_once: dict[str, list[float]] = field(default_factory=dict)
    prompt_ids: int = 0
    completion_ids: int = 0
    finish_reason: str = ""


def _answer(turn: int) -> dict[str, Any]:
    """The assistant message `fake_upstream.py` answers on `turn` (0-based), as a client gets it."""
    function = {"name": "bash", "arguments": json.dumps({"command": f"ls -la dir{turn}"})}
    call = {"id": f"call_{turn}", "type": "function", "function": function}
    return {"role": "assistant", "content": "", "reasoning": REASONING, "tool_calls": [call]}


def _client_body(call: int, max_tokens: int) -> dict[str, Any]:
    """The body of the session's `call` (1-based) as `session_load.py` sends it."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."}]
    for turn in range(call - 1):
        answer = _answer(turn)
        results = [
            {"role": "tool", "tool_call_id": c["id"], "content": TOOL_OUTPUT}
            for c in answer["tool_calls"]
        ]
        messages = [*messages, _replayed(answer), *results]
    return {
        "model": "policy",
        "messages": messages,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": False,
    }


class Upstream:
    """One keep-alive HTTP/1.1 connection to the upstream, one request at a time."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.hostname not in _LOOPBACK or parts.scheme != "http":
            raise SystemExit(f"--url must be http:// on loopback (127.0.0.1, ::1), not {url!r}")
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)

    def post(self, path: str, body: bytes) -> tuple[float, bytes]:
        """Send `body`; the seconds until the whole answer was read, and the answer."""
        headers = {"Content-Type": "application/json"}
        t0 = time.perf_counter()
        self.conn.request("POST", path, body=body, headers=headers)
        resp = self.conn.getresponse()
        data = resp.read()
        elapsed = time.perf_counter() - t0
        if resp.status != 200:
            raise SystemExit(f"POST {path} answered {resp.status}: {data[:300]!r}")
        return elapsed, data


def build(upstream: Upstream, call: int, max_tokens: int) -> Shape:
    """The requests of the session's `call`, as the proxy would send them; the render and
    generate answers the later routes take are asked for once here."""
    request = normalize_request(_client_body(call, max_tokens)).body
    previous = normalize_request(_client_body(call - 1, max_tokens)).body
    # `match` and `plan` read the previous call's request and answer, not its ids.
    prior = Prior(
        previous, _answer(call - 2), prompt_ids=(), completion_ids=(), finish_reason="stop"
    )
    extension = match(prior, request)
    if not isinstance(extension, Extension):
        raise SystemExit(f"call {call} does not extend the previous one: {extension}")
    bridge = plan(request, extension)
    chat = VLLMAdapter().plan(request).body
    # The render body as token-in sends it: the forwarded request without the stream keys.
    render_request = orjson.loads(chat)
    for key in ("stream", "stream_options"):
        render_request.pop(key, None)
    render = orjson.dumps(render_request)
    routes = [Route("chat", CHAT, chat), Route("render", RENDER, render)]
    names = ["close-A", "close-B", "turn-A", "turn-B", "suffix-A", "suffix-B"]
    if bridge.turn is None:
        raise SystemExit(f"call {call}: the replayed answer has no tool calls")
    dummies = [*bridge.close, *bridge.turn, *bridge.suffix]
    routes += [Route(n, RENDER, orjson.dumps(b)) for n, b in zip(names, dummies, strict=True)]
    # What the proxy sends once a template's anchors are known: one lean render of each kind
    # (docs/token-in.md, "Lean dummies" and "One render instead of a pair").
    lean = plan(request, extension, lean=True)
    assert lean.turn is not None
    routes += [
        Route("lean-turn", RENDER, orjson.dumps(lean.turn[0])),
        Route("lean-suffix", RENDER, orjson.dumps(lean.suffix[0])),
    ]
    # The route's cost apart from the conversation's size: one short message, no tools.
    tiny = {"model": request["model"], "messages": [{"role": "user", "content": "u"}]}
    routes.append(Route("render-tiny", RENDER, orjson.dumps(tiny)))
    _, raw = upstream.post(RENDER, render)
    rendered = read_render(raw)
    # The limit said even where vLLM's render leaves it out (`Rendered.resolved_sampling`), so
    # generate samples what chat samples.
    generate = rendered.generate_body()
    _, generated_raw = upstream.post(GENERATE, generate)
    generated = read_generate(generated_raw)
    derender = derender_body(generated_raw, rendered.prompt_ids, render)
    routes += [Route("generate", GENERATE, generate), Route("derender", DERENDER, derender)]
    return Shape(
        call,
        {r.name: r for r in routes},
        prompt_ids=len(rendered.prompt_ids),
        completion_ids=len(generated.completion_ids),
        finish_reason=generated.finish_reason or "",
    )


#: The renders a bridged call after a tool-call answer sends at once (the close pair cached):
#: with whole pairs (before lean dummies and anchors), and now (one lean render of each kind).
AT_ONCE = {
    "whole pairs": ("render", "turn-A", "turn-B", "suffix-A", "suffix-B"),
    "lean, one each": ("render", "lean-turn", "lean-suffix"),
}


def _at_once(
    pool: ThreadPoolExecutor, conns: list[Upstream], shape: Shape, names: tuple[str, ...]
) -> float:
    """Send the routes `names` together, one per connection; the seconds until the last
    answer."""
    routes = [shape.routes[n] for n in names]
    t0 = time.perf_counter()
    done = [pool.submit(c.post, r.path, r.body) for c, r in zip(conns, routes, strict=False)]
    for future in done:
        future.result()
    return time.perf_counter() - t0


def measure(upstream: Upstream, shapes: list[Shape], args: argparse.Namespace) -> int:
    """Time every route of every shape in turn, then its `AT_ONCE` renders together; the
    number of timed rounds."""
    conns = [Upstream(args.url, args.timeout) for _ in range(max(map(len, AT_ONCE.values())))]
    with ThreadPoolExecutor(len(conns)) as pool:
        for _ in range(args.warmup):
            for shape in shapes:
                for route in shape.routes.values():
                    upstream.post(route.path, route.body)
                for names in AT_ONCE.values():
                    _at_once(pool, conns, shape, names)
        deadline = time.monotonic() + args.max_seconds
        rounds = 0
        while rounds < args.repeat and time.monotonic() < deadline:
            for shape in shapes:
                for route in shape.routes.values():
                    route.times.append(upstream.post(route.path, route.body)[0])
                for label, names in AT_ONCE.items():
                    shape.at_once.setdefault(label, []).append(_at_once(pool, conns, shape, names))
            rounds += 1
    return rounds


def _p(values: list[float], q: float) -> float:
    """The `q` quantile of `values` in ms (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def _round_sums(shape: Shape, names: tuple[str, ...], rounds: int) -> list[float]:
    """Per timed round, the seconds the routes `names` of `shape` took together."""
    return [sum(shape.routes[n].times[i] for n in names) for i in range(rounds)]


#: What a bridged call sends, per the replayed answer: with tool calls the plain render, the
#: turn and the suffix dummies (the close pair cached), without them the suffix only; whole
#: pairs (before lean dummies and anchors) or one lean render of each kind (now).
SUMS = {
    "whole pairs, answer with tool calls": ("render", "turn-A", "turn-B", "suffix-A", "suffix-B"),
    "whole pairs, answer without tool calls": ("render", "suffix-A", "suffix-B"),
    "lean, one each, answer with tool calls": ("render", "lean-turn", "lean-suffix"),
    "lean, one each, answer without tool calls": ("render", "lean-suffix"),
}


def report(shapes: list[Shape], rounds: int) -> str:
    """The markdown tables."""
    lines = [
        "| call | prompt ids | route | body KB | p50 ms | p90 ms |",
        "|--:|--:|---|--:|--:|--:|",
    ]
    for s in shapes:
        for r in s.routes.values():
            lines.append(
                f"| {s.call} | {s.prompt_ids} | {r.name} | {len(r.body) / 1024:.1f} "
                f"| {_p(r.times, 0.5):.2f} | {_p(r.times, 0.9):.2f} |"
            )
        for label, names in AT_ONCE.items():
            size = sum(len(s.routes[n].body) for n in names) / 1024
            times = s.at_once[label]
            lines.append(
                f"| {s.call} | {s.prompt_ids} | {' + '.join(names)} at once ({label}) "
                f"| {size:.1f} | {_p(times, 0.5):.2f} | {_p(times, 0.9):.2f} |"
            )
    lines += [
        "",
        "| call | token-in sends | token-in p50 (p90) ms | of which renders + derender p50 ms "
        "| chat p50 (p90) ms | difference ms | ratio |",
        "|--:|---|--:|--:|--:|--:|--:|",
    ]
    for s in shapes:
        chat = s.routes["chat"].times
        c50 = _p(chat, 0.5)
        for label, renders in SUMS.items():
            sums = _round_sums(s, (*renders, "generate", "derender"), rounds)
            frontend = _round_sums(s, (*renders, "derender"), rounds)
            t50 = _p(sums, 0.5)
            what = f"{len(renders)} renders, generate, derender ({label})"
            lines.append(
                f"| {s.call} | {what} | {t50:.2f} ({_p(sums, 0.9):.2f}) "
                f"| {_p(frontend, 0.5):.2f} | {c50:.2f} ({_p(chat, 0.9):.2f}) "
                f"| {t50 - c50:+.2f} | {t50 / c50:.2f}× |"
            )
    return "\n".join(lines)


def _start_fake() -> tuple[subprocess.Popen[str], str]:
    """`fake_upstream.py` on a free loopback port, and its URL once it listens."""
    script = Path(__file__).with_name("fake_upstream.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"fake_upstream.py did not start: {line!r}")
    return proc, line.split()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running upstream on loopback (http://127.0.0.1:PORT)")
    where.add_argument("--fake", action="store_true", help="start fake_upstream.py for the run")
    p.add_argument("--repeat", type=int, default=20, help="timed rounds at most")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--max-seconds", type=float, default=90.0, help="timed rounds stop after")
    p.add_argument("--max-tokens", type=int, default=16, help="the calls' output limit")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    args = p.parse_args()
    fake = None
    if args.fake:
        fake, args.url = _start_fake()
    try:
        upstream = Upstream(args.url, args.timeout)
        load = os.getloadavg()[0]
        shapes = [build(upstream, call, args.max_tokens) for call in CALLS]
        began = time.monotonic()
        rounds = measure(upstream, shapes, args)
        took = time.monotonic() - began
        print(
            f"upstream {args.url}; {rounds} rounds after {args.warmup} warm-up in {took:.1f} s; "
            f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after; "
            f"max_tokens {args.max_tokens}; generated "
            + ", ".join(f"{s.completion_ids} ids ({s.finish_reason})" for s in shapes)
        )
        print()
        print(report(shapes, rounds))
    finally:
        if fake is not None:
            fake.terminate()
            fake.wait(10)


if __name__ == "__main__":
    main()
