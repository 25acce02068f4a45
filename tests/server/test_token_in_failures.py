"""How token-in calls fail, as the client sees it and as the rollout's ledger records it: the
plain path's endings (upstream errors before and after the first byte, a client that leaves, a
store that fails), derender failing, an upstream restarted, a proxy restarted between turns."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus
from capture_proxy.schemas.token_in_extras import segment_break_of
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.testing.fake_vllm import FakeVLLM, Fault, Turn
from tests.server.test_token_in_flow import SYSTEM, TOOLS, assert_extends, fake
from tests.support.proxy_harness import Proxy, chat_body, sse_lines, start_proxy, stop_proxy, user
from tests.upstream.test_upstream_restart import restart

DERENDER = "/v1/chat/completions/derender"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FailingDerender(FakeVLLM):
    """The fake, its derender route answering 500 while `failing` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(scale_out=True, drop_past_reasoning=True, **kwargs)
        self.failing = True

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def fail(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path == DERENDER and self.failing:
                error = {"error": {"message": "parser crashed", "type": "InternalServerError"}}
                return web.json_response(error, status=500)
            return await handler(request)

        app.middlewares.append(fail)
        return app


async def _events(resp: aiohttp.ClientResponse) -> list[bytes]:
    return [line async for line in sse_lines(resp) if line]


async def test_a_client_leaving_a_stream_held_by_the_byte_bound_aborts_the_generation(
    make_proxy: Any,
) -> None:
    """With the default bound the fake's stream is derendered once, at its end (its prompt ids
    alone are beyond 3x the plain call's bytes): a client that leaves before then still has the
    generation aborted, and the call is in the ledger."""
    p = await make_proxy(fake=FakeVLLM(scale_out=True, chunk_delay=0.05), token_in="on")
    resp = await p.chat(chat_body(user("a long answer please"), stream=True))
    assert resp.status == 200  # the headers came; no chunk will before the generation ends
    for _ in range(100):
        if p.fake.body_bytes["/inference/v1/generate"]:  # generating
            break
        await asyncio.sleep(0.01)
    resp.close()  # the client goes away
    for _ in range(100):
        if p.failures() and p.fake.aborted:
            break
        await asyncio.sleep(0.05)
    _only_failure(p, CallStatus.ABORTED, "client_disconnected")
    assert p.fake.aborted == 1
    assert p.calls() == []


def _only_failure(p: Proxy, status: CallStatus, reason: str) -> Any:
    (entry,) = p.failures()
    assert (entry.status, entry.reason) == (status, reason), entry
    assert p.calls() == []
    return entry


async def test_a_token_in_call_is_refused_like_a_plain_one(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    resp = await p.chat(chat_body(user("a"), n=2))
    assert resp.status == 422
    assert resp.headers["X-Capture-Status"] == "rejected"
    assert (await resp.json())["error"]["param"] == "n"
    _only_failure(p, CallStatus.REJECTED, "capture_disabled")
    assert p.fake.route_hits["/inference/v1/generate"] == 0


async def test_generate_answering_an_error_is_relayed_and_recorded(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    p.fake.push(Turn(fault=Fault.http_error(500)), Turn(fault=Fault.http_error(500)))
    for stream in (False, True):
        resp = await p.chat(chat_body(user("a"), stream=stream))
        assert resp.status == 500
        assert resp.headers["X-Capture-Status"] == "upstream_error"
        assert "error" in await resp.json()
    entries = p.failures()
    assert [(e.status, e.reason, e.http_status) for e in entries] == [
        (CallStatus.UPSTREAM_ERROR, "upstream_500", 500)
    ] * 2


async def test_generate_breaking_mid_stream_ends_with_an_error_event(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    p.fake.push(Turn("a fairly long answer to cut", fault=Fault.reset_after(3)))
    resp = await p.chat(chat_body(user("a"), stream=True))
    assert resp.status == 200
    events = await _events(resp)
    assert b"data: [DONE]" not in events
    assert "error" in orjson.loads(events[-1][6:])
    entry = _only_failure(p, CallStatus.UPSTREAM_ERROR, "upstream_broken")
    assert entry.http_status == 502


async def test_a_malformed_generate_answer_fails_the_call_before_derender_is_sent(
    make_proxy: Any,
) -> None:
    # Derender is scheduled before generate's answer is read for the record; a malformed answer
    # must still fail the call and cancel that request before anything reaches vLLM.
    p = await make_proxy(fake=fake(), token_in="on")
    p.fake.push(Turn("an answer cut in half", fault=Fault.truncate_after(0)))
    resp = await p.chat(chat_body(user("a")))
    assert resp.status == 502
    assert resp.headers["X-Capture-Status"] == "upstream_error"
    error = (await resp.json())["error"]
    assert error["message"].startswith("the upstream answer is malformed"), error
    entry = _only_failure(p, CallStatus.UPSTREAM_ERROR, error["code"])
    assert entry.http_status == 502
    await asyncio.sleep(0.05)  # a derender sent by mistake would have reached the fake by now
    assert p.fake.route_hits[DERENDER] == 0
    assert p.fake.route_hits["/inference/v1/generate"] == 1


async def test_derender_failing_is_an_upstream_error(make_proxy: Any) -> None:
    p = await make_proxy(fake=FailingDerender(), token_in="on")
    resp = await p.chat(chat_body(user("a")))
    assert resp.status == 502
    assert resp.headers["X-Capture-Status"] == "upstream_error"
    error = (await resp.json())["error"]
    assert error["code"] == "derender_failed"
    assert "parser crashed" in error["message"]
    resp = await p.chat(chat_body(user("b"), stream=True))
    assert resp.status == 200
    events = await _events(resp)
    assert b"data: [DONE]" not in events
    assert orjson.loads(events[-1][6:])["error"]["code"] == "derender_failed"
    assert [(e.reason, e.http_status) for e in p.failures()] == [("derender_failed", 502)] * 2
    assert p.calls() == []


async def test_a_client_leaving_mid_stream_aborts_the_generation(make_proxy: Any) -> None:
    # A bound with room for derender calls before the stream ends: the client reads a chunk.
    fake = FakeVLLM(scale_out=True, chunk_delay=0.05)
    p = await make_proxy(fake=fake, token_in="on", token_in_upstream_bound=100.0)
    resp = await p.chat(chat_body(user("a long answer please"), stream=True))
    await resp.content.readline()
    resp.close()  # the client goes away
    for _ in range(100):
        if p.failures() and p.fake.aborted:
            break
        await asyncio.sleep(0.05)
    _only_failure(p, CallStatus.ABORTED, "client_disconnected")
    assert p.fake.aborted == 1


async def test_a_store_failing_leaves_the_call_not_staged(make_proxy: Any) -> None:
    def broken(point: str) -> None:
        raise OSError("disk I/O error")

    sink = MemorySink(fault=broken)
    p = await make_proxy(fake=fake(), sink=sink, token_in="on")
    resp = await p.chat(chat_body(user("x")))
    assert resp.status == 200
    assert resp.headers["X-Capture-Status"] == "capture_failed"
    _only_failure(p, CallStatus.CAPTURE_FAILED, "sink_error")
    assert not p.state.capture.rollouts["r1"].token_in_priors  # nothing to continue


async def test_a_restarted_upstream_is_used_for_the_next_call(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    messages = [SYSTEM, user("One.")]
    resp = await p.chat(chat_body(*messages))
    first = (await resp.json())["choices"][0]["message"]
    await restart(p, FakeVLLM(scale_out=True, drop_past_reasoning=True, version="0.32.1"))
    replayed = {"role": "assistant", "content": first["content"], "reasoning": first["reasoning"]}
    resp = await p.chat(chat_body(*messages, replayed, user("Two.")))
    assert resp.headers["X-Capture-Status"] == "staged"
    records = p.calls()
    assert [r.upstream_version for r in records] == ["0.32.0", "0.32.1"]
    assert_extends(records)
    assert segment_break_of(records[1].extras) is None
    assert p.fake.route_hits["/inference/v1/generate"] == 1  # sent once, to the new process


async def test_a_restarted_proxy_continues_from_the_store(tmp_path: Path) -> None:
    upstream = fake()
    messages: list[dict[str, Any]] = [SYSTEM, user("One.")]
    for n, text in enumerate(("Two.", "Three.")):
        p = await start_proxy(tmp_path, fake=upstream, token_in="on")
        try:
            resp = await p.chat(chat_body(*messages, tools=TOOLS))
            assert resp.headers["X-Capture-Status"] == "staged"
            message = (await resp.json())["choices"][0]["message"]
            [(seq, _)] = p.state.capture.rollouts["r1"].token_in_priors.values()
            assert seq == n  # the last staged call, from the store after the first restart
        finally:
            await stop_proxy(p)
        replayed = {"role": "assistant", "content": message["content"]}
        replayed["reasoning"] = message["reasoning"]
        messages += [replayed, user(text)]
    p = await start_proxy(tmp_path, fake=upstream, token_in="on")
    try:
        resp = await p.chat(chat_body(*messages, tools=TOOLS))
        assert resp.headers["X-Capture-Status"] == "staged"
        records = p.calls()
    finally:
        await stop_proxy(p)
    assert len(records) == 3
    assert_extends(records)
    assert [segment_break_of(r.extras) is None for r in records] == [False, True, True]
    traj = open_store(f"sqlite:///{tmp_path / 'store.db'}").trajectory("r1", include_open=True)
    assert len(traj.segments) == 1
