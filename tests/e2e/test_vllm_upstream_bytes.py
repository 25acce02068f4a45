"""A token-in call sends the real vLLM 0.32 at most 3× the bytes the plain call sends (`-m vllm`).

Issue 28's bound, held on the whole call: the request's own render, the bridge's dummy renders,
generate (the prompt as ids) and every derender call, request lines and headers included, unary
and streamed. Both proxies reach the same vLLM through a loopback relay that counts every byte
they send it (`capture_proxy.testing.byte_relay`); the session is an agent's (a system prompt and
tools, a user message, the answer replayed, a second user message), and its second call, bridged
by token-in, is measured. Against the fake vLLM the bound cannot be held on the whole call: its
byte-level template makes the prompt's ids 3.7–4× the text's bytes
(tests/server/test_token_in_upstream_bytes.py holds the rest there).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.testing.byte_relay import ByteRelay, by_kind
from examples.rl_loop.agent import TOOLS
from tests.support.parity import agent_view
from tests.support.proxy_harness import Proxy, start_proxy, stop_proxy

pytestmark = pytest.mark.vllm

#: An agent's system prompt: about 1k ids of the tiny model's tokenizer.
SYSTEM = {
    "role": "system",
    "content": "You are a coding agent working in a repository; use the tools, keep answers "
    "short. " * 40,
}


def first_call(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "policy",
        "messages": [SYSTEM, {"role": "user", "content": "List the files."}],
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 8,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def second_call_bytes(p: Proxy, relay: ByteRelay, rollout: str, stream: bool) -> int:
    """Play the session; the bytes the proxy sent vLLM for its second call."""
    post = functools.partial(p.chat, rollout=rollout)
    first = first_call(stream)
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
    print(f"\n{rollout}: {by_kind(sent, len(second['messages']))}")
    return sum(s.size for s in sent)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_bridged_token_in_call_sends_vllm_at_most_three_times_the_plain_call_s_bytes(
    vllm_url: str, tmp_path: Path, stream: bool
) -> None:
    relay = ByteRelay(int(vllm_url.rsplit(":", 1)[1]))
    upstream = f"http://127.0.0.1:{await relay.start()}"
    plain = await start_proxy(tmp_path / "plain", upstream=upstream)
    token_in = await start_proxy(tmp_path / "token-in", upstream=upstream, token_in="on")
    try:
        want = await second_call_bytes(plain, relay, "plain", stream)
        # The first session learns the template's close and anchors; the second is measured.
        await second_call_bytes(token_in, relay, "learn", stream)
        got = await second_call_bytes(token_in, relay, "measured", stream)
        [_, bridged] = token_in.calls("measured")
        assert bridged.token_in
        assert bridged.bridge_spans  # extended, not a new segment
    finally:
        await stop_proxy(plain)
        await stop_proxy(token_in)
        await relay.close()
    print(f"plain {want} B, token-in {got} B: {got / want:.3f}x")
    assert got <= 3 * want
