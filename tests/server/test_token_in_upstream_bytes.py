"""What a token-in call sends upstream is bounded by the plain call's, whatever the chunking.

The same scripted answer goes through a proxy on the plain path and one with token-in on, each in
front of its own fake vLLM, which counts the request bytes it receives per route. A streamed
token-in call sends the request to render, the prompt's ids to generate, and derender calls; each
derender call resends only what vLLM's derender reads (the prompt's tail, the chat request without
the conversation's text, generate's events without what derender does not read), and the calls
get what ``--token-in-upstream-bound`` times the plain call's bytes leaves after render and
generate, then wait for the stream's end (docs/token-in.md, "Upstream bytes").

The fake cannot show the default bound (3×) on the whole call: its byte-level template makes
generate's prompt ids alone 3.7–4× the request's bytes, which no derender policy changes. So here
the default bound holds a stream's derender calls to one, at its end, and everything but generate
under 3×; a bound with room (6×) is held on the whole call, whatever the pace of the tokens. The
whole call under 3× is held against the real vLLM, whose ids are about 1.8× the request's bytes:
tests/e2e/test_vllm_upstream_bytes.py.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest

from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
from tests.support.parity import agent_view
from tests.support.proxy_harness import Proxy, chat_body, user

GENERATE = "/inference/v1/generate"
DERENDER = "/v1/chat/completions/derender"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the sandbox and return its output. " * 20,
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
#: An agent's conversation: a long system prompt, tools, earlier turns with reasoning.
SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 500}
HISTORY = [
    user("List the files."),
    {"role": "assistant", "reasoning_content": "Look first.", "content": "Listing."},
    user("Now count them."),
]
ANSWER = Turn("I will count them now.", reasoning="Count the lines of ls.", tool_calls=[])
TOOL_ANSWER = Turn(reasoning="Run it.", tool_calls=[FakeToolCall("bash", {"command": "ls | wc"})])
#: A hostile body: one 0.19 MiB user message, answered one token per derender call.
HOSTILE = chat_body(user("x" * 200_000), temperature=0, max_tokens=200)

#: name -> (answer, body, seconds between generate events: 0 coalesces everything, 0.06 gives
#: one token per derender call, after the coalescer's 50 ms floor).
CASES: dict[str, tuple[Turn, dict[str, Any], float]] = {
    "agent, coalesced": (ANSWER, chat_body(SYSTEM, *HISTORY, tools=TOOLS), 0.0),
    "agent, one token per call": (ANSWER, chat_body(SYSTEM, *HISTORY, tools=TOOLS), 0.06),
    "agent tool call, one token per call": (
        TOOL_ANSWER,
        chat_body(SYSTEM, *HISTORY, tools=TOOLS),
        0.06,
    ),
    "agent with top logprobs, one token per call": (
        ANSWER,
        chat_body(SYSTEM, *HISTORY, tools=TOOLS, logprobs=True, top_logprobs=5),
        0.06,
    ),
    "hostile body, one token per call": (Turn("ok " * 15, reasoning="hmm " * 5), HOSTILE, 0.06),
}


async def sent(
    make_proxy: Any,
    token_in: str,
    turn: Turn,
    body: dict[str, Any],
    delay: float,
    bound: float = 3.0,
) -> collections.Counter[str]:
    """The request bytes the proxy sent its fake vLLM for one streamed call, per route."""
    fake = FakeVLLM(scale_out=True, chunk_delay=delay, max_model_len=400_000)
    p: Proxy = await make_proxy(fake=fake, token_in=token_in, token_in_upstream_bound=bound)
    p.fake.push(turn)
    before = collections.Counter(p.fake.body_bytes)
    streamed = {**body, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    await agent_view(p.chat, streamed)
    [record] = p.calls()
    assert record.token_in is (token_in == "on")
    return p.fake.body_bytes - before


@pytest.mark.parametrize("case", list(CASES))
async def test_with_no_room_left_by_generate_a_stream_is_derendered_once_at_its_end(
    make_proxy: Any, case: str
) -> None:
    turn, body, delay = CASES[case]
    plain = await sent(make_proxy, "off", turn, body, 0.0)  # the plain call's bytes: any pace
    token_in = await sent(make_proxy, "on", turn, body, delay)
    beyond_generate = token_in.total() - token_in[GENERATE]
    print(f"\n{case}: plain {plain.total()} B, token-in {dict(token_in)}")
    assert token_in[GENERATE] > 3 * plain.total()  # the fake's ids: nothing left for derender
    assert beyond_generate <= 3 * plain.total()
    if body.get("logprobs") is not True:
        assert token_in[DERENDER] < 1024  # one call: the chat request's tools, the answer's ids


@pytest.mark.parametrize("case", list(CASES))
async def test_a_streamed_token_in_call_sends_at_most_its_bound_times_the_plain_bytes(
    make_proxy: Any, case: str
) -> None:
    turn, body, delay = CASES[case]
    plain = await sent(make_proxy, "off", turn, body, 0.0)
    token_in = await sent(make_proxy, "on", turn, body, delay, bound=6.0)
    print(f"\n{case}: plain {plain.total()} B, token-in {dict(token_in)}")
    assert token_in[DERENDER] > 0
    # Asked for, the answer's logprobs go upstream once (the plain call never sends them):
    # beyond the bound by what the last call carries, all of them when the stream is held.
    once = 0
    if body.get("logprobs") is True:
        once = (await sent(make_proxy, "on", turn, body, 0.0))[DERENDER]  # held: any pace
    assert token_in.total() <= 6 * plain.total() + once
