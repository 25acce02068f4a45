"""The lean client of token-in's requests (`capture_proxy.upstream.rpc`), through
`HTTPUpstream.post_engine`: what the caller gets for each way an answer can go wrong.

The fake vLLM answers with well-formed HTTP; the answers that break the protocol (a reset
mid-body, a stall, ``Connection: close``, chunked or unframed bodies, streams) come from a
scripted server on loopback that writes the bytes each test gives it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from capture_proxy.adapters.vllm import UpstreamProtocolError, read_render
from capture_proxy.core.transport import EngineRoute
from capture_proxy.errors import UpstreamFailed
from capture_proxy.testing.fake_vllm import FakeVLLM, serve_fake
from capture_proxy.upstream import HTTPUpstream

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
BODY = orjson.dumps(CHAT)
OK = b'{"token_ids":[1,2,3]}'

#: One scripted answer: given the stream writer, writes (and may wait, or close).
Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


class Scripted:
    """A loopback server answering each request with the next of `answers`; it records each
    request's head and counts the connections it accepted."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,  # a GET
                )
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                await self.answers.pop(0)(writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1):
                await self.server.wait_closed()


def answer(raw: bytes, *, then_close: bool = False) -> Answer:
    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(raw)
        await writer.drain()
        if then_close:
            writer.close()

    return write


def json_answer(body: bytes, status: str = "200 OK", extra: str = "") -> Answer:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}"
    return answer(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)


def stalled(first: bytes, seconds: float) -> Answer:
    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(first)
        await writer.drain()
        await asyncio.sleep(seconds)

    return write


async def post(up: HTTPUpstream, route: EngineRoute = EngineRoute.RENDER) -> tuple[int, bytes]:
    async with await up.post_engine(route, BODY) as reply:
        return reply.status, await reply.read()


async def failure(
    server: Scripted,
    call: Callable[[HTTPUpstream], Awaitable[object]] = post,
    **settings: Any,
) -> UpstreamFailed:
    """What `call` raises against the scripted `server` (the upstream closed either way)."""
    async with server as url:
        up = HTTPUpstream(url, **settings)
        try:
            with pytest.raises(UpstreamFailed) as info:
                await call(up)
        finally:
            await up.close()
    return info.value


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeVLLM, HTTPUpstream]]:
    fake, runner, url = await serve_fake(scale_out=True)
    up = HTTPUpstream(url)
    try:
        yield fake, up
    finally:
        await up.close()
        await runner.cleanup()


async def test_render_and_derender_answers_come_whole_on_one_kept_connection(
    fake: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    _, up = fake
    status, raw = await post(up)
    assert status == 200
    ids = read_render(raw).prompt_ids  # the fake's rendering, read as generate needs it
    assert ids
    for _ in range(3):
        assert read_render((await post(up))[1]).prompt_ids == ids
    assert up._rpc is not None
    assert len(up._rpc._idle) == 1  # one connection, kept between the four requests
    status, refused = await post(up, EngineRoute.DERENDER)
    assert status == 400  # a refusal comes back for the caller to relay
    assert orjson.loads(refused)["error"]["message"].startswith("chat_request is required")


def test_it_runs_on_uvloop_the_proxys_default_loop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def renders_and_a_stream() -> tuple[list[int], bytes]:
        _, runner, url = await serve_fake(scale_out=True)
        up = HTTPUpstream(url)
        try:
            statuses = [(await post(up))[0] for _ in range(3)]
            rendered = orjson.loads((await post(up))[1])
            body = orjson.dumps({**rendered, "stream": True})
            async with await up.post_engine(EngineRoute.GENERATE, body) as reply:
                streamed = b"".join([chunk async for chunk in reply.chunks()])
            return statuses, streamed
        finally:
            await up.close()
            await runner.cleanup()

    statuses, streamed = uvloop.run(renders_and_a_stream())
    assert statuses == [200, 200, 200]
    assert streamed.endswith(b"data: [DONE]\n\n")


async def test_the_api_key_and_the_body_are_sent() -> None:
    server = Scripted(json_answer(OK))
    async with server as url:
        up = HTTPUpstream(url, api_key="k3y")
        try:
            assert await post(up, EngineRoute.DERENDER) == (200, OK)
        finally:
            await up.close()
    head = server.heads[0].decode()
    assert head.startswith("POST /v1/chat/completions/derender HTTP/1.1\r\n")
    assert "Authorization: Bearer k3y\r\n" in head
    assert "Content-Type: application/json\r\n" in head
    assert server.bodies == [BODY]


async def test_a_facts_request_goes_without_the_headers_vllm_does_not_read() -> None:
    # The engine's weight version, read around each plain call through the facts pool
    # (aiohttp): no User-Agent, Accept or Accept-Encoding (85 bytes a request), the API key and
    # Host kept.
    server = Scripted(json_answer(b'{"weight_version":"v7"}'))
    async with server as url:
        up = HTTPUpstream(url, api_key="k3y")
        try:
            assert await up.read_engine_weight_version() == "v7"
        finally:
            await up.close()
    head = server.heads[0].decode()
    assert head.startswith("GET /weight_info HTTP/1.1\r\n")
    names = {line.split(":", 1)[0].lower() for line in head.split("\r\n")[1:] if line}
    assert names == {"host", "authorization"}


async def test_an_error_status_comes_back_with_its_body() -> None:
    error = b'{"error":{"message":"boom","code":500}}'
    server = Scripted(json_answer(error, "500 Internal Server Error"))
    async with server as url:
        up = HTTPUpstream(url)
        try:
            assert await post(up) == (500, error)
        finally:
            await up.close()


async def test_a_non_json_answer_is_the_callers_protocol_error() -> None:
    server = Scripted(json_answer(b"<html>oops</html>"))
    async with server as url:
        up = HTTPUpstream(url)
        try:
            status, raw = await post(up)
        finally:
            await up.close()
    assert (status, raw) == (200, b"<html>oops</html>")
    with pytest.raises(UpstreamProtocolError) as info:
        read_render(raw)
    assert info.value.reason == "malformed_json"


async def test_a_reset_mid_body_is_upstream_broken() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"
    server = Scripted(answer(head + b'{"token_ids":[1,', then_close=True))
    failed = await failure(server, post)
    assert failed.code == "upstream_broken"
    assert failed.message.startswith("the upstream answer broke off")


async def test_a_connection_closed_before_any_answer_is_upstream_unreachable() -> None:
    server = Scripted(answer(b"", then_close=True))
    failed = await failure(server, post)
    assert failed.code == "upstream_unreachable"
    assert failed.message.startswith("cannot reach the upstream")


async def test_a_refused_connection_is_upstream_unreachable() -> None:
    server = Scripted()
    async with server as url:
        pass  # closed: nothing listens on its port now
    up = HTTPUpstream(url)
    try:
        with pytest.raises(UpstreamFailed) as info:
            await post(up, EngineRoute.DERENDER)
    finally:
        await up.close()
    assert info.value.code == "upstream_unreachable"
    assert isinstance(info.value.__cause__, OSError)


async def test_no_answer_within_the_first_byte_timeout_is_upstream_timeout() -> None:
    server = Scripted(stalled(b"", 2.0))
    failed = await failure(server, post, first_byte_timeout=0.2)
    assert (failed.code, failed.status) == ("upstream_timeout", 504)
    assert failed.message == "the upstream sent no response within 0.2s"


async def test_a_body_that_stalls_past_the_idle_timeout_is_upstream_broken() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
    server = Scripted(stalled(head + b'{"token_ids":', 2.0))
    failed = await failure(server, post, idle_timeout=0.2)
    assert failed.code == "upstream_broken"


async def test_each_piece_of_a_slow_body_restarts_the_idle_timeout() -> None:
    body = b'{"token_ids":[1,2,3]}'
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()

    async def in_pieces(writer: asyncio.StreamWriter) -> None:
        # Six pieces 0.15 s apart: 0.75 s in all, each wait under the 0.3 s idle timeout.
        for piece in (head + body[:4], *(body[i : i + 4] for i in range(4, len(body), 4))):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.15)

    async with Scripted(in_pieces) as url:
        up = HTTPUpstream(url, idle_timeout=0.3)
        try:
            assert await post(up) == (200, body)
        finally:
            await up.close()


async def test_a_body_not_whole_by_the_total_timeout_is_upstream_deadline() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
    server = Scripted(stalled(head + b'{"token_ids":', 2.0))
    failed = await failure(server, post, idle_timeout=5.0, total_timeout=0.3)
    assert (failed.code, failed.status) == ("upstream_deadline", 504)
    assert "--upstream-total-timeout" in failed.message


async def test_connection_close_answers_are_read_and_the_next_request_opens_another() -> None:
    server = Scripted(
        json_answer(OK, extra="Connection: close\r\n"),
        json_answer(OK),
    )
    async with server as url:
        up = HTTPUpstream(url)
        try:
            assert await post(up) == (200, OK)
            assert await post(up) == (200, OK)
        finally:
            await up.close()
    assert server.connections == 2


async def test_a_chunked_answer_is_joined() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked += b'6\r\n{"toke\r\nf\r\nn_ids":[1,2,3]}\r\n0\r\n\r\n'
    server = Scripted(answer(chunked), json_answer(OK))
    async with server as url:
        up = HTTPUpstream(url)
        try:
            assert await post(up) == (200, OK)
            assert await post(up) == (200, OK)  # the connection was kept
        finally:
            await up.close()
    assert server.connections == 1


async def test_an_answer_without_a_length_ends_with_its_connection() -> None:
    server = Scripted(answer(b"HTTP/1.1 200 OK\r\n\r\n" + OK, then_close=True))
    async with server as url:
        up = HTTPUpstream(url)
        try:
            assert await post(up) == (200, OK)
        finally:
            await up.close()


async def test_a_reply_left_unread_closes_its_connection() -> None:
    server = Scripted(json_answer(OK), json_answer(OK))
    async with server as url:
        up = HTTPUpstream(url)
        try:
            async with await up.post_engine(EngineRoute.RENDER, BODY) as reply:
                assert reply.status == 200
            assert await post(up) == (200, OK)
        finally:
            await up.close()
    assert server.connections == 2


async def test_a_garbled_answer_is_upstream_unreachable() -> None:
    server = Scripted(answer(b"NOT HTTP AT ALL\r\n\r\n"))
    failed = await failure(server, post)
    assert failed.code == "upstream_unreachable"


def stream_of(*pieces: tuple[bytes, float], close: bool = False) -> Answer:
    """A chunked answer written piece by piece, each after its delay."""

    async def write(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        for data, delay in pieces:
            await asyncio.sleep(delay)
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        if close:
            writer.close()
            return
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return write


async def read_stream(up: HTTPUpstream) -> list[bytes]:
    async with await up.post_engine(EngineRoute.GENERATE, BODY) as reply:
        return [chunk async for chunk in reply.chunks()]


async def test_a_streamed_generate_arrives_as_it_is_sent_and_keeps_its_connection() -> None:
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    server = Scripted(stream_of(*((e, 0.05) for e in events)), json_answer(OK))
    async with server as url:
        up = HTTPUpstream(url)
        try:
            chunks = await read_stream(up)
            assert await post(up) == (200, OK)
        finally:
            await up.close()
    assert b"".join(chunks) == b"".join(events)
    assert len(chunks) == 3  # each piece as it came, not the whole body at the end
    assert server.connections == 1


async def test_a_stream_that_sends_nothing_for_the_idle_timeout_is_upstream_idle_timeout() -> None:
    server = Scripted(stream_of((b"data: 1\n\n", 0.0), (b"data: 2\n\n", 2.0)))
    failed = await failure(server, read_stream, idle_timeout=0.2)
    assert failed.code == "upstream_idle_timeout"
    assert failed.message == "the upstream sent nothing for 0.2s mid-stream"


async def test_a_stream_not_whole_by_the_total_timeout_is_upstream_deadline() -> None:
    pieces = [(b"data: x\n\n", 0.1)] * 10
    server = Scripted(stream_of(*pieces))
    failed = await failure(server, read_stream, idle_timeout=5.0, total_timeout=0.35)
    assert (failed.code, failed.status) == ("upstream_deadline", 504)


async def test_a_stream_reset_midway_is_upstream_broken() -> None:
    server = Scripted(stream_of((b"data: 1\n\n", 0.0), close=True))
    failed = await failure(server, read_stream)
    assert failed.code == "upstream_broken"
    assert failed.message.startswith("the upstream stream broke")


async def test_a_stream_left_midway_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"9\r\ndata: 1\n\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.02)
        except ConnectionError:
            closed.set()

    server = Scripted(endless)
    async with server as url:
        up = HTTPUpstream(url)
        try:
            async with await up.post_engine(EngineRoute.GENERATE, BODY) as reply:
                async for _ in reply.chunks():
                    break  # the client went away
            async with asyncio.timeout(2):
                await closed.wait()  # the upstream saw it (vLLM aborts the generation)
        finally:
            await up.close()
