"""`StreamedDerender`: a streamed generate turned into the client's chunks by coalesced derender
calls, against the fake vLLM over real HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from capture_proxy.adapters.vllm import Rendered, read_render
from capture_proxy.core.token_in import StreamedDerender
from capture_proxy.core.transport import EngineRoute, UpstreamReply
from capture_proxy.errors import UpstreamFailed
from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Fault, Turn, serve_fake
from capture_proxy.upstream import HTTPUpstream

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
CHAT = {
    "model": "policy",
    "messages": [{"role": "user", "content": "list files"}],
    "tools": TOOLS,
    "max_tokens": 2000,
}


@pytest.fixture
async def pair() -> AsyncIterator[tuple[FakeVLLM, HTTPUpstream]]:
    fake, runner, url = await serve_fake(scale_out=True)
    up = HTTPUpstream(url)
    try:
        yield fake, up
    finally:
        await up.close()
        await runner.cleanup()


async def post(up: HTTPUpstream, route: EngineRoute, body: bytes) -> Any:
    async with await up.post_engine(route, body) as reply:
        return orjson.loads(await reply.read())


async def streamed(
    up: HTTPUpstream, rendered: Any, chat: dict[str, Any] = CHAT
) -> tuple[UpstreamReply, StreamedDerender]:
    reply = await up.post_engine(EngineRoute.GENERATE, rendered.generate_body(stream=True))
    return reply, StreamedDerender(up, reply, list(rendered.prompt_ids), chat)


def joined(events: list[bytes]) -> dict[str, Any]:
    content, reasoning, args, name = "", "", "", None
    for e in events[:-1]:
        for choice in orjson.loads(e[len(b"data: ") :])["choices"]:
            d = choice["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning") or ""
            for c in d.get("tool_calls") or []:
                name = name or c["function"]["name"]
                args += c["function"]["arguments"] or ""
    return {"content": content, "reasoning": reasoning, "name": name, "arguments": args}


async def test_the_streamed_deltas_equal_the_unary_derender_in_few_calls(
    pair: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    fake, up = pair
    turn = Turn(
        "Let me look. " * 20,
        reasoning="think " * 40,
        tool_calls=[FakeToolCall("bash", {"command": "ls"})],
    )
    fake.push(turn, turn)
    rendered = read_render(orjson.dumps(await post(up, EngineRoute.RENDER, orjson.dumps(CHAT))))
    prompt = list(rendered.prompt_ids)
    reply, driver = await streamed(up, rendered)
    async with reply:
        events = [e async for e in driver.events()]
    assert events[-1] == b"data: [DONE]\n\n"
    generated = driver.generated
    assert generated is not None
    n = len(generated.completion_ids)
    assert n > 400
    usage = orjson.loads(events[-2][len(b"data: ") :])
    assert (usage["choices"], usage["usage"]["completion_tokens"]) == ([], n)
    assert driver.calls < n / 10, (driver.calls, n)
    unary_gen = await post(up, EngineRoute.GENERATE, rendered.generate_body())
    body = {"generate_response": unary_gen, "prompt_token_ids": prompt, "chat_request": CHAT}
    unary = await post(up, EngineRoute.DERENDER, orjson.dumps(body))
    message = unary["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert joined(events) == {
        "content": message["content"],
        "reasoning": message["reasoning"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
    }
    assert list(generated.completion_ids) == unary_gen["choices"][0]["token_ids"]


async def test_a_refused_derender_call_is_derender_failed(
    pair: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    _, up = pair
    rendered = read_render(orjson.dumps(await post(up, EngineRoute.RENDER, orjson.dumps(CHAT))))
    reply, driver = await streamed(up, rendered, {**CHAT, "model": "other"})
    async with reply:
        with pytest.raises(UpstreamFailed) as info:
            _ = [e async for e in driver.events()]
    assert info.value.code == "derender_failed"
    assert info.value.message.startswith("derender answered 404: ")
    assert "The model `other` does not exist" in info.value.message


async def test_a_broken_generate_stream_fails_the_answer(
    pair: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    fake, up = pair
    fake.push(Turn("x" * 200, fault=Fault.reset_after(5)))
    rendered = read_render(orjson.dumps(await post(up, EngineRoute.RENDER, orjson.dumps(CHAT))))
    reply, driver = await streamed(up, rendered)
    async with reply:
        with pytest.raises(UpstreamFailed) as info:
            _ = [e async for e in driver.events()]
    assert info.value.code == "upstream_broken"


async def short_answer(fake: FakeVLLM, up: HTTPUpstream) -> Rendered:
    """`CHAT` rendered, the fake's next answer a short text."""
    fake.push(Turn("Short."))
    return read_render(orjson.dumps(await post(up, EngineRoute.RENDER, orjson.dumps(CHAT))))


async def test_the_usage_chunk_comes_without_a_derender_call(
    pair: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    fake, up = pair
    rendered = await short_answer(fake, up)
    reply, driver = await streamed(up, rendered)
    async with reply:
        events = [e async for e in driver.events()]
    chunks = [orjson.loads(e[len(b"data: ") :]) for e in events[:-1]]
    *answer, usage = chunks
    generated = driver.generated
    assert generated is not None
    # Every chunk before it from derender; the usage chunk built from the last one's fields
    # and generate's counts, as derender writes it (held to vLLM's in tests/adapters).
    assert fake.route_hits["/v1/chat/completions/derender"] == driver.calls == len(answer)
    assert usage == {
        **answer[-1],
        "choices": [],
        "usage": {
            "prompt_tokens": len(rendered.prompt_ids),
            "total_tokens": len(rendered.prompt_ids) + len(generated.completion_ids),
            "completion_tokens": len(generated.completion_ids),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }


async def test_an_event_without_choices_or_usage_goes_to_derender(
    pair: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    fake, up = pair
    rendered = await short_answer(fake, up)
    async with await up.post_engine(
        EngineRoute.GENERATE, rendered.generate_body(stream=True)
    ) as reply:
        stream = await reply.read()
    # The same stream, its last event with neither choices nor usage (vLLM never sends one:
    # the proxy does not make it up), served by a plain HTTP server.
    lines = stream.split(b"\n\n")
    usage_at = next(i for i, e in enumerate(lines) if b'"choices":[]' in e)
    event = orjson.loads(lines[usage_at][len(b"data: ") :])
    event["usage"] = None
    lines[usage_at] = b"data: " + orjson.dumps(event)

    async def generate(_: web.Request) -> web.Response:
        return web.Response(body=b"\n\n".join(lines), content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    server = TestServer(app)
    await server.start_server()
    canned = HTTPUpstream(str(server.make_url("")))
    try:
        before = fake.route_hits["/v1/chat/completions/derender"]
        async with await canned.post_engine(EngineRoute.GENERATE, b"{}") as reply:
            driver = StreamedDerender(up, reply, list(rendered.prompt_ids), CHAT)
            events = [e async for e in driver.events()]
        calls = fake.route_hits["/v1/chat/completions/derender"] - before
        # Derender was asked for that chunk too: every chunk is derender's.
        assert calls == driver.calls == len(events) - 1
        assert events[-1] == b"data: [DONE]\n\n"
    finally:
        await canned.close()
        await server.close()
