"""Logprobs of token-in answers through the real proxy, against the fake vLLM: a streamed answer's
chunks carry the chat route's logprobs for the tokens they carry (resolved by derender), a
unary one has them too, and the relay rules of the plain path hold."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
from capture_proxy.testing.fake_vllm._protocol import decoded_token
from tests.support.proxy_harness import Proxy, chat_body, sse_lines, user

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
DERENDER = "/v1/chat/completions/derender"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: ``--token-in-upstream-bound`` for streams derendered in pieces: the fake's byte-level
#: template makes generate alone about 4x the plain call's bytes (the default 3 leaves no room
#: for any derender call before a stream ends).
BOUND = 100.0


def turn() -> Turn:
    return Turn(
        "Here it is: é, ü and 世界. " * 3,
        reasoning="Let me think about it. " * 4,
        tool_calls=[FakeToolCall("bash", {"command": "ls -la"})],
    )


def body(**extra: Any) -> dict[str, Any]:
    return chat_body(user("List the files."), tools=TOOLS, logprobs=True, top_logprobs=2, **extra)


async def chunks(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    assert resp.status == 200, await resp.text()
    out = []
    async for line in sse_lines(resp):
        if line.startswith(b"data: {"):
            out.append(orjson.loads(line[6:]))
    return out


def entries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e
        for event in events
        for choice in event["choices"]
        for e in (choice.get("logprobs") or {}).get("content") or ()
    ]


async def streamed(p: Proxy, **extra: Any) -> list[dict[str, Any]]:
    p.fake.push(turn())
    return await chunks(await p.chat(body(stream=True, **extra)))


async def test_a_streamed_answer_carries_the_chat_routes_logprobs(make_proxy: Any) -> None:
    token_in = await make_proxy(fake=FakeVLLM(scale_out=True), token_in="on")
    plain = await make_proxy(fake=FakeVLLM(scale_out=True))
    got = await streamed(token_in, stream_options={"include_usage": True})
    want = await streamed(plain, stream_options={"include_usage": True})
    assert entries(got) == entries(want)
    [record] = token_in.calls()
    lp = entries(got)
    assert len(lp) == len(record.completion_token_ids)
    assert [e["logprob"] for e in lp] == list(record.completion_logprobs)
    assert all(len(e["top_logprobs"]) == 2 for e in lp)
    assert got[-1]["choices"] == []  # the usage chunk has no tokens to carry them for


async def test_each_streamed_chunk_carries_the_logprobs_of_its_own_tokens(
    make_proxy: Any,
) -> None:
    # Tokens arriving apart: several coalesced derender calls, each resolving its own.
    # A bound with room for many derender calls: the stream comes in pieces.
    p = await make_proxy(
        fake=ResolvingCounter(chunk_delay=0.01), token_in="on", token_in_upstream_bound=BOUND
    )
    events = await streamed(p, return_token_ids=True)
    carried = [c for e in events for c in e["choices"] if c.get("token_ids")]
    assert len(carried) > 3
    [record] = p.calls()
    ids = list(record.completion_token_ids)
    assert [t for c in carried for t in c["token_ids"]] == ids
    # Each token's bytes as vLLM resolves them (a character split across tokens, even across
    # chunks: empty, then whole on the token that completes it).
    at = 0
    for choice in carried:
        content = choice["logprobs"]["content"]
        want = [
            decoded_token(t, ids[max(0, at + k - 4) : at + k]).encode()
            for k, t in enumerate(choice["token_ids"])
        ]
        assert [bytes(e["bytes"]) for e in content] == want
        at += len(choice["token_ids"])
    assert p.fake.unary_derenders == len(carried)  # one resolution per chunk with tokens


async def test_a_unary_answer_carries_the_chat_routes_logprobs(make_proxy: Any) -> None:
    token_in = await make_proxy(fake=FakeVLLM(scale_out=True), token_in="on")
    plain = await make_proxy(fake=FakeVLLM(scale_out=True))
    answers = []
    for p in (token_in, plain):
        p.fake.push(turn())
        resp = await p.chat(body())
        assert resp.status == 200
        answers.append(await resp.json())
    got, want = (a["choices"][0]["logprobs"]["content"] for a in answers)
    assert got == want
    [record] = token_in.calls()
    assert [e["logprob"] for e in got] == list(record.completion_logprobs)


async def test_a_streamed_answer_without_logprobs_asked_has_none(make_proxy: Any) -> None:
    p = await make_proxy(fake=ResolvingCounter(), token_in="on")
    p.fake.push(turn())
    events = await chunks(await p.chat(chat_body(user("a"), tools=TOOLS, stream=True)))
    assert all(c["logprobs"] is None for e in events for c in e["choices"])
    assert p.fake.unary_derenders == 0  # no call made to resolve them


class ResolvingCounter(FakeVLLM):
    """The fake, counting unary derender calls (a streamed answer's makes none but the ones
    that resolve logprobs); with `resolve_fails`, those answer 500."""

    def __init__(self, *, resolve_fails: bool = False, chunk_delay: float = 0.0) -> None:
        super().__init__(scale_out=True, chunk_delay=chunk_delay)
        self.resolve_fails = resolve_fails
        self.unary_derenders = 0

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path == DERENDER and b'"stream":true' not in await request.read():
                self.unary_derenders += 1
                if self.resolve_fails:
                    error = {"error": {"message": "tokenizer gone", "type": "InternalServerError"}}
                    return web.json_response(error, status=500)
            return await handler(request)

        app.middlewares.append(count)
        return app


async def test_a_refused_logprobs_resolution_ends_the_stream_with_an_error(
    make_proxy: Any,
) -> None:
    p = await make_proxy(fake=ResolvingCounter(resolve_fails=True), token_in="on")
    p.fake.push(turn())
    resp = await p.chat(body(stream=True))
    assert resp.status == 200
    lines = [line async for line in sse_lines(resp) if line]
    assert b"data: [DONE]" not in lines
    error = orjson.loads(lines[-1][6:])["error"]
    assert error["code"] == "derender_failed"
    assert "derender answered 500" in error["message"]
    assert "tokenizer gone" in error["message"]
    assert [(e.reason, e.http_status) for e in p.failures()] == [("derender_failed", 502)]
    assert p.calls() == []


class WithoutParser(ResolvingCounter):
    """The fake, its streamed derender resolving logprobs itself, as vLLM's does on a server
    without a reasoning or tool parser (here: a marker entry per chunk)."""

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def resolve(request: web.Request, handler: Handler) -> web.StreamResponse:
            response = await handler(request)
            if request.path != DERENDER or b'"stream":true' not in await request.read():
                return response
            assert isinstance(response, web.Response)
            assert response.body is not None
            answer = orjson.loads(bytes(response.body))  # type: ignore[arg-type]
            for choice in answer["chunk"]["choices"]:
                choice["logprobs"] = {"content": [{"token": "own", "logprob": 0.0}]}
            return web.json_response(answer)

        app.middlewares.insert(0, resolve)
        return app


async def test_a_streamed_derender_that_resolves_logprobs_itself_is_not_asked_again(
    make_proxy: Any,
) -> None:
    # A bound with room for many derender calls: the stream comes in pieces.
    p = await make_proxy(
        fake=WithoutParser(chunk_delay=0.01), token_in="on", token_in_upstream_bound=BOUND
    )
    events = await streamed(p)
    carried = [c for e in events for c in e["choices"]]
    assert len(carried) > 3
    assert all(c["logprobs"]["content"][0]["token"] == "own" for c in carried)
    assert p.fake.unary_derenders == 1  # only beside the first call, before it was known


class ExtraLogprob(FakeVLLM):
    """The fake, its unary derender answers carrying one logprobs entry more than the ids."""

    def __init__(self) -> None:
        super().__init__(scale_out=True)

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def extra(request: web.Request, handler: Handler) -> web.StreamResponse:
            resp = await handler(request)
            if request.path != DERENDER or not isinstance(resp, web.Response):
                return resp
            answer = orjson.loads(resp.body)  # type: ignore[arg-type]
            for choice in answer.get("choices") or ():
                content = (choice.get("logprobs") or {}).get("content")
                if content:
                    content.append(content[-1])
            return web.json_response(answer)

        app.middlewares.append(extra)
        return app


async def test_logprobs_without_their_ids_fail_a_call_asking_for_token_id_strings(
    make_proxy: Any,
) -> None:
    # With `return_tokens_as_token_ids` each entry is written as "token_id:N" for generate's id
    # at its place: an entry derender has beyond generate's ids has none, and the call fails
    # as for a malformed answer (never a guessed id).
    p = await make_proxy(fake=ExtraLogprob(), token_in="on")
    p.fake.push(turn(), turn())
    resp = await p.chat(body(return_tokens_as_token_ids=True))
    assert resp.status == 502
    assert resp.headers["X-Capture-Status"] == "upstream_error"
    error = (await resp.json())["error"]
    assert error["code"] == "logprobs_mismatch"
    assert "generate sampled" in error["message"]
    resp = await p.chat(body(return_tokens_as_token_ids=True, stream=True))
    assert resp.status == 200
    events = [line async for line in sse_lines(resp) if line]
    assert b"data: [DONE]" not in events
    assert orjson.loads(events[-1][6:])["error"]["code"] == "logprobs_mismatch"
    assert [(e.reason, e.http_status) for e in p.failures()] == [("logprobs_mismatch", 502)] * 2
    assert p.calls() == []
