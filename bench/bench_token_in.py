"""What the token-in bridge costs per call, beside decoding and encoding the call's body once.

    .venv/bin/python bench/bench_token_in.py --turns 30 --repeat 200

Builds an OpenCode-like session with the fake vLLM's template (a system prompt, a tool list,
turns of reasoning + a tool call + its result), then times for its last call: `match` (the
history compared with the previous call's), `plan` (the render bodies and the close key) and
`assemble` (the renders' common suffixes and the bridged prompt), the render answers given (the
render round trips are upstream time, not the bridge's). Beside it, in the same run: one
``orjson.loads`` + ``orjson.dumps`` of the call's body, which every captured call pays at least.
Reported: median microseconds of each, and the bridge's total as a ratio to the body's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from capture_proxy.core.token_in import BridgeRenders, Extension, Prior, assemble, match, plan
from capture_proxy.testing.fake_vllm._template import IM_END, encode, render_chat, tool_call_text


def _ids(body: dict[str, Any]) -> list[int]:
    gen = body.get("add_generation_prompt", True) is not False
    return encode(render_chat(body["messages"], body.get("tools"), add_generation_prompt=gen))


def _session(turns: int) -> tuple[Prior, dict[str, Any]]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool{i}",
                "description": "d" * 400,
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        }
        for i in range(12)
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " * 200},
        {"role": "user", "content": "fix the bug"},
    ]
    for t in range(turns):
        args = json.dumps({"x": f"file{t}.py"})
        call = {"id": f"c{t}", "type": "function", "function": {"name": "tool1", "arguments": args}}
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "r" * 300,
                "tool_calls": [call],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"c{t}", "content": "out " * 150})
    args = json.dumps({"x": "last.py"})
    call = {"id": "cl", "type": "function", "function": {"name": "tool1", "arguments": args}}
    answer = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "r" * 300,
        "tool_calls": [call],
    }
    request = {"model": "policy", "messages": messages, "tools": tools}
    sampled = encode("<think>\n" + "r" * 300 + "\n</think>\n\n" + tool_call_text("tool1", args))
    prior = Prior(request, answer, _ids(request), [*sampled, IM_END], "stop")
    new = {**request, "messages": [*messages, dict(answer), {"role": "tool", "content": "x"}]}
    return prior, new


def _median_us(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    prior, request = _session(args.turns)
    ext = match(prior, request)
    assert isinstance(ext, Extension), ext
    p = plan(request, ext)
    assert p.turn is not None
    rendered = BridgeRenders(
        (_ids(p.close[0]), _ids(p.close[1])),
        (_ids(p.suffix[0]), _ids(p.suffix[1])),
        (_ids(p.turn[0]), _ids(p.turn[1])),
    )
    body = orjson.dumps(request)
    figures = {
        "match": _median_us(lambda: match(prior, request), args.repeat),
        "plan": _median_us(lambda: plan(request, ext), args.repeat),
        "assemble": _median_us(lambda: assemble(prior, p, rendered), args.repeat),
        "body loads+dumps": _median_us(lambda: orjson.dumps(orjson.loads(body)), args.repeat),
    }
    bridge = figures["match"] + figures["plan"] + figures["assemble"]
    print(
        f"prompt {len(prior.prompt_ids)} ids, completion {len(prior.completion_ids)}, "
        f"body {len(body)} bytes, {len(request['messages'])} messages"
    )
    for name, us in figures.items():
        print(f"  {name:18} {us:9.1f} us")
    print(
        f"  bridge total       {bridge:9.1f} us = {bridge / figures['body loads+dumps']:.2f}x body"
    )


if __name__ == "__main__":
    main()
