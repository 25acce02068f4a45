"""A token-in call sends the real vLLM 0.32 at most 3× the bytes the plain call sends (`-m vllm`).

Issue 28's bound, held on the whole call: the request's own render, the bridge's dummy renders
(if any), generate (the prompt as ids) and every derender call, request lines and headers
included, unary and streamed. Both proxies reach the same vLLM through a loopback relay that
counts every byte they send it (`capture_proxy.testing.byte_relay`); the session is an agent's, as
bench/bench_token_in_vllm.py plays it (a system prompt and nine tools or one, a user message,
the answer replayed, a second user message), and its second call, bridged by token-in, is
measured: after a first answer that ended its turn on the end of sequence and after one cut by
`length`.

The plain call's bytes are its chat request's: with vLLM's dev mode (as here) the plain path
also reads the engine's weight version around each call (two ``GET /weight_info``, 104 bytes),
which token-in does not; those are not counted in its favour.

The bound holds where generate's prompt ids leave room for the rest: with the tiny model's
tokenizer they are 1.8× the request's bytes with the nine tools, 1.9× with examples/rl_loop's one
tool with a short description, so render (1×) and generate leave 0.1–0.2× for derender. A steady
call makes no dummy render (docs/token-in.md, "A steady call without dummy renders"): measured
2.944–2.994× unary and 2.933–2.970× streamed over the four sessions here (2026-12-05); a call of
the short-tool shape that makes one is at 3.056× and is not held here. Against the fake vLLM the
bound cannot be held on the whole call (its byte-level template makes the ids 3.7–4× the text):
tests/server/test_token_in_upstream_bytes.py holds the rest there.

With room in the bound, a stream is derendered in pieces; that it still answers what the chat
route answers is shown here too (tests/e2e/test_vllm_parity.py runs the default bound, which
derenders those short requests' streams once, at their end).
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import pytest

import examples.rl_loop.agent as rl_loop_agent
from capture_proxy.testing.byte_relay import ByteRelay, by_kind, request_kind
from scripts import tiny_vllm
from tests.e2e.test_vllm_parity import SHAPES, request, views_that_differ
from tests.support.parity import agent_view
from tests.support.proxy_harness import Proxy, start_proxy, stop_proxy

pytestmark = pytest.mark.vllm

#: An agent's system prompt and tools: about 4k ids of the tiny model's tokenizer.
SYSTEM = {
    "role": "system",
    "content": "You are a coding agent working in a repository; use the tools, keep answers "
    "short. " * 40,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name}: "
            + "Runs the operation on the workspace and returns its output. " * 6,
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "what to run"}},
                "required": ["command"],
            },
        },
    }
    for name in ("bash", "read", "write", "edit", "glob", "grep", "list", "webfetch", "todo")
]
#: examples/rl_loop's one tool, with a short description: its prompt ids are 1.9× the
#: request's bytes (1.8× with the nine described tools).
SHORT_TOOLS = rl_loop_agent.TOOLS
TOOL_SETS = {"nine": TOOLS, "short": SHORT_TOOLS}


def first_call(stream: bool, tools: str = "nine", end: int | None = None) -> dict[str, Any]:
    """The session's first request; `end`: an end-of-sequence id the answer is made to stop on
    at once (a logit bias), else the tiny model's answer is cut at 8 tokens."""
    body: dict[str, Any] = {
        "model": "policy",
        "messages": [SYSTEM, {"role": "user", "content": "List the files."}],
        "tools": TOOL_SETS[tools],
        "temperature": 0,
        "max_tokens": 8,
    }
    if end is not None:
        body["logit_bias"] = {str(end): 100}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def second_call_bytes(
    p: Proxy,
    relay: ByteRelay,
    rollout: str,
    stream: bool,
    *,
    kinds: frozenset[str] | None = None,
    tools: str = "nine",
    end: int | None = None,
) -> int:
    """Play the session; the bytes the proxy sent vLLM for its second call (of the requests of
    `kinds` only, when given: `request_kind`)."""
    post = functools.partial(p.chat, rollout=rollout)
    first = first_call(stream, tools, end)
    await agent_view(post, first)
    staged = p.calls(rollout)[-1].response  # the answer as the agent replays it
    replayed = {"role": "assistant", "content": staged.get("content") or ""}
    if staged.get("reasoning_content"):
        replayed["reasoning_content"] = staged["reasoning_content"]
    second = {
        **first,
        "messages": [*first["messages"], replayed, {"role": "user", "content": "Go on."}],
    }
    mark = len(relay.log)
    await agent_view(post, second)
    sent = relay.since(mark)
    messages = len(second["messages"])
    print(f"\n{rollout}: {by_kind(sent, messages)}")
    return sum(s.size for s in sent if kinds is None or request_kind(s, messages) in kinds)


#: The plain call's own request. With vLLM's dev mode (as here) the plain path also reads the
#: engine's weight version before and after each call (two ``GET /weight_info``, 104 bytes),
#: which token-in does not (generate reports its weights): not counted in the plain call's
#: favour.
PLAIN_CALL = frozenset({"chat"})


@pytest.mark.parametrize("ending", ["stop", "length"])
@pytest.mark.parametrize("tools", sorted(TOOL_SETS))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_bridged_token_in_call_sends_vllm_at_most_three_times_the_plain_call_s_bytes(
    vllm_url: str, tmp_path: Path, stream: bool, tools: str, ending: str
) -> None:
    end = await asyncio.to_thread(tiny_vllm.end_of_sequence, int(vllm_url.rsplit(":", 1)[1]))
    relay = ByteRelay(int(vllm_url.rsplit(":", 1)[1]))
    upstream = f"http://127.0.0.1:{await relay.start()}"
    plain = await start_proxy(tmp_path / "plain", upstream=upstream)
    token_in = await start_proxy(tmp_path / "token-in", upstream=upstream, token_in="on")
    # The measured session's first answer ends its turn on the end of sequence, or is cut by
    # `length` (the tiny model's eight newlines, which its template renders as nothing).
    measured_end = end if ending == "stop" else None
    try:
        want = await second_call_bytes(
            plain, relay, "plain", stream, kinds=PLAIN_CALL, tools=tools, end=measured_end
        )
        # A first session learns the template's close and end of sequence, and how many of
        # them the appended messages hold; the second is measured.
        await second_call_bytes(token_in, relay, "learn", stream, tools=tools, end=end)
        got = await second_call_bytes(
            token_in, relay, "measured", stream, tools=tools, end=measured_end
        )
        [first, bridged] = token_in.calls("measured")
        assert first.finish_reason == ending
        assert bridged.token_in
        assert bridged.bridge_spans  # extended, not a new segment
    finally:
        await stop_proxy(plain)
        await stop_proxy(token_in)
        await relay.close()
    print(f"plain {want} B, token-in {got} B: {got / want:.3f}x")
    assert got <= 3 * want


async def test_with_room_in_the_bound_a_stream_in_pieces_answers_what_the_chat_route_answers(
    vllm_url: str, tmp_path: Path
) -> None:
    """Every shape streamed through both proxies, compared as the parity suite compares them
    (`views_that_differ`: a shape is sent again while the engine sampled different ids, or
    while the views differ only in the chat route's own streamed reasoning count, which
    depends on how vLLM's chunks fell; a difference on every attempt still fails)."""
    plain = await start_proxy(tmp_path / "plain", upstream=vllm_url)
    token_in = await start_proxy(
        tmp_path / "token-in", upstream=vllm_url, token_in="on", token_in_upstream_bound=1000.0
    )
    try:
        bodies = [(name, True, request(extra, True)) for name, extra in SHAPES.items()]
        differ = await views_that_differ(plain, token_in, bodies)
    finally:
        await stop_proxy(plain)
        await stop_proxy(token_in)
    assert differ == {}
