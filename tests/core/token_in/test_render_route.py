"""A plan's bodies are what the fake vLLM's render route takes, and its answers bridge exactly.

The fake serves ``POST /v1/chat/completions/render`` with vLLM 0.32's answer shape and the
Qwen3-style template that drops earlier reasoning; the bridge gets its renders over real HTTP,
all of a plan's requests at once, as the flow will send them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from capture_proxy.core.token_in import (
    Bridged,
    BridgeRenders,
    Extension,
    Prior,
    assemble,
    divergence,
    match,
    plan,
)
from capture_proxy.testing.fake_vllm import FakeVLLM
from capture_proxy.testing.fake_vllm._template import IM_END, encode, tool_call_text

Client = TestClient[web.Request, web.Application]
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


async def render(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions/render", json=body)
    assert resp.status == 200, await resp.text()
    answer: dict[str, Any] = await resp.json()
    return answer


async def test_a_tool_call_then_a_user_message_bridge_through_the_render_route(
    aiohttp_client: Callable[[web.Application], Awaitable[Client]],
) -> None:
    client = await aiohttp_client(FakeVLLM(scale_out=True, drop_past_reasoning=True).app())
    first: dict[str, Any] = {
        "model": "policy",
        "tools": TOOLS,
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "ls"}],
    }
    args = '{"c":"ls"}'
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": args}}
    answer = {"role": "assistant", "content": "", "reasoning_content": "ok", "tool_calls": [call]}
    sampled = [*encode("<think>\nok\n</think>\n\n" + tool_call_text("bash", args)), IM_END]
    prior = Prior(first, answer, (await render(client, first))["token_ids"], sampled, "stop")
    # OpenCode replays the reasoning as `reasoning` (normalized), the arguments re-serialized.
    replayed = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "ok",
        "tool_calls": [{**call, "function": {"name": "bash", "arguments": '{"c": "ls"}'}}],
    }
    result = {"role": "tool", "tool_call_id": "c1", "content": "a.py"}
    request = {**first, "messages": [*first["messages"], replayed, result]}
    ext = match(prior, request)
    assert isinstance(ext, Extension), ext
    p = plan(request, ext)
    assert p.turn is not None
    answers = await asyncio.gather(*(render(client, body) for body in p.requests()))
    rendered = BridgeRenders.from_answers(
        close=(answers[0], answers[1]),
        turn=(answers[2], answers[3]),
        suffix=(answers[4], answers[5]),
    )
    bridged = assemble(prior, p, rendered)
    assert isinstance(bridged, Bridged), bridged
    exact = [*prior.prompt_ids, *prior.completion_ids]
    assert bridged.prompt_ids == [
        *exact,
        *encode("\n<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n"),
        *encode("<|im_start|>assistant\n"),
    ]
    assert bridged.bridge_spans == ((len(exact), len(exact) + 1, "turn_close"),)
    plain = (await render(client, request))["token_ids"]
    where = divergence(bridged.prompt_ids, plain)
    assert where is not None
    assert where > len(prior.prompt_ids)  # inside the re-serialized call
