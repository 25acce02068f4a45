"""`HTTPUpstream.post_engine`: vLLM's token-in routes (render, generate, derender) against the
fake vLLM over real HTTP, with the chat route's timeouts and error mapping."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from capture_proxy.adapters.vllm import UpstreamProtocolError, read_generate
from capture_proxy.core.transport import EngineRoute, TokenInTransport
from capture_proxy.errors import UpstreamFailed
from capture_proxy.testing.fake_vllm import FakeVLLM, Fault, Turn, serve_fake
from capture_proxy.upstream import HTTPUpstream

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}


async def upstream_for(**kwargs: Any) -> AsyncIterator[tuple[FakeVLLM, HTTPUpstream]]:
    fake, runner, url = await serve_fake(**kwargs)
    up = HTTPUpstream(url)
    try:
        yield fake, up
    finally:
        await up.close()
        await runner.cleanup()


@pytest.fixture
async def scale_out() -> AsyncIterator[tuple[FakeVLLM, HTTPUpstream]]:
    async for pair in upstream_for(scale_out=True):
        yield pair


async def post_json(up: HTTPUpstream, route: EngineRoute, body: Any) -> tuple[int, Any]:
    async with await up.post_engine(route, orjson.dumps(body)) as reply:
        return reply.status, orjson.loads(await reply.read())


async def test_render_generate_and_derender_round_trip(
    scale_out: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    fake, up = scale_out
    assert isinstance(up, TokenInTransport)
    fake.push(Turn("hello", reasoning="hm"))
    status, rendered = await post_json(up, EngineRoute.RENDER, CHAT)
    assert status == 200
    status, generated = await post_json(up, EngineRoute.GENERATE, rendered)
    assert status == 200
    assert generated["choices"][0]["token_ids"] == fake.responses[0]["completion_token_ids"]
    body = {"generate_response": generated, "prompt_token_ids": rendered["token_ids"]}
    status, answer = await post_json(up, EngineRoute.DERENDER, {**body, "chat_request": CHAT})
    assert status == 200
    message = answer["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == ("hello", "hm")


async def test_a_streamed_generate_arrives_in_chunks(
    scale_out: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    _, up = scale_out
    _, rendered = await post_json(up, EngineRoute.RENDER, CHAT)
    body = orjson.dumps({**rendered, "stream": True})
    async with await up.post_engine(EngineRoute.GENERATE, body) as reply:
        raw = b"".join([chunk async for chunk in reply.chunks()])
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_an_upstream_without_scale_out_is_named_with_its_flag() -> None:
    async for _, up in upstream_for():
        for route in EngineRoute:
            with pytest.raises(UpstreamFailed) as info:
                await up.post_engine(route, orjson.dumps(CHAT))
            assert (info.value.code, info.value.status) == ("scale_out_disabled", 503)
            assert "--enable-scale-out" in info.value.message


async def test_another_refusal_comes_back_for_the_caller_to_relay(
    scale_out: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    _, up = scale_out
    status, body = await post_json(up, EngineRoute.DERENDER, {"generate_response": {}})
    assert status == 400
    assert body["error"]["message"].startswith("chat_request is required")


async def test_an_unreachable_upstream_is_upstream_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    up = HTTPUpstream(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(UpstreamFailed) as info:
            await up.post_engine(EngineRoute.RENDER, orjson.dumps(CHAT))
    finally:
        await up.close()
    assert info.value.code == "upstream_unreachable"
    assert info.value.__cause__ is not None


async def test_a_slow_generate_times_out_like_a_chat_call() -> None:
    async for fake, up in upstream_for(scale_out=True):
        up.first_byte_timeout = 0.2
        fake.push(Turn("x", fault=Fault.delay_first_byte(2.0)))
        _, rendered = await post_json(up, EngineRoute.RENDER, CHAT)
        with pytest.raises(UpstreamFailed) as info:
            await up.post_engine(EngineRoute.GENERATE, orjson.dumps(rendered))
        assert (info.value.code, info.value.status) == ("upstream_timeout", 504)
        assert isinstance(info.value.__cause__, TimeoutError)


async def test_a_generate_stream_that_breaks_is_upstream_broken() -> None:
    async for fake, up in upstream_for(scale_out=True):
        fake.push(Turn("a long answer", fault=Fault.reset_after(3)))
        _, rendered = await post_json(up, EngineRoute.RENDER, CHAT)
        body = orjson.dumps({**rendered, "stream": True})
        async with await up.post_engine(EngineRoute.GENERATE, body) as reply:
            with pytest.raises(UpstreamFailed) as info:
                _ = [chunk async for chunk in reply.chunks()]
        assert info.value.code == "upstream_broken"


async def test_a_truncated_generate_answer_is_a_protocol_error() -> None:
    async for fake, up in upstream_for(scale_out=True):
        fake.push(Turn("an answer", fault=Fault.truncate_after(1)))
        _, rendered = await post_json(up, EngineRoute.RENDER, CHAT)
        async with await up.post_engine(EngineRoute.GENERATE, orjson.dumps(rendered)) as reply:
            raw = await reply.read()
        with pytest.raises(UpstreamProtocolError) as info:
            read_generate(raw)
        assert info.value.reason == "malformed_json"
        assert info.value.error_body["error"]["code"] == 502
