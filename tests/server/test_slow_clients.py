"""Slow and greedy clients (issue 19): deadlines on reading requests and on answers left unread,
and a cap on open connections, each shown as the client sees it.

The proxy is started as ``capture-proxy serve`` starts it (`capture_proxy.server.run.listen`: its
connection gate, its runner options) on loopback, in front of a fake vLLM; the clients are raw
sockets, which can stop halfway through a request or stop reading an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestServer

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus
from capture_proxy.server.run import Listening, connection_budget, listen
from capture_proxy.server.settings import Settings
from capture_proxy.server.state import STATE
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn

CHAT = "/r/slow/v1/chat/completions"
BODY = orjson.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]})


@dataclass
class Served:
    listening: Listening
    fake: FakeVLLM
    store_url: str

    @property
    def port(self) -> int:
        return int(self.listening.url.rsplit(":", 1)[1])

    def failures(self, rollout: str = "slow") -> list[Any]:
        with open_store(self.store_url) as store:
            return store.failures(rollout)

    def staged(self, rollout: str = "slow") -> list[Any]:
        with open_store(self.store_url) as store:
            return store.calls(rollout, include_open=True, include_poisoned=True)


@contextlib.asynccontextmanager
async def served(
    tmp_path: Path, fake: FakeVLLM | None = None, **values: Any
) -> AsyncIterator[Served]:
    fake = fake or FakeVLLM()
    upstream = TestServer(fake.app())
    await upstream.start_server()
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    settings = Settings(
        **{
            "upstream": str(upstream.make_url("")).rstrip("/"),
            "store": store_url,
            "port": 0,
            "min_free_disk_mb": 0,
            **values,
        }
    )
    listening = await listen(settings, open_files=65536)
    try:
        yield Served(listening, fake, store_url)
    finally:
        await listening.close()
        await upstream.close()


def head(path: str = CHAT, *, length: int | None = None, extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: proxy", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


async def answer_of(
    reader: asyncio.StreamReader, within: float = 10
) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one answer with a Content-Length."""
    async with asyncio.timeout(within):
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(":") for line in lines[1:] if ":" in line)
        }
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), headers, body


async def closed_within(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the proxy sent before closing the connection (it must close within `within`)."""
    out = b""
    async with asyncio.timeout(within):
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                out += chunk
    return out


async def honest_call(port: int, path: str = CHAT) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head(path, length=len(BODY)) + BODY)
        return await answer_of(reader)
    finally:
        writer.close()


# -- request heads ---------------------------------------------------------------------------


async def test_a_head_sent_slower_than_the_header_deadline_gets_the_connection_closed(
    tmp_path: Path,
) -> None:
    async with served(tmp_path, client_header_timeout=1.0) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        started = time.monotonic()
        writer.write(b"POST /r/slow/v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n")

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for byte in b"X-Slow: " + b"a" * 100:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.1)

        dripping = asyncio.create_task(trickle())
        sent = await closed_within(reader, within=5)
        took = time.monotonic() - started
        dripping.cancel()
        writer.close()
        # The client sees its connection closed, without an answer, at the deadline, although
        # it was still sending a byte every 0.1 s.
        assert sent == b""
        assert 0.9 < took < 3.5, took
        assert s.fake.requests == []
        assert (await honest_call(s.port))[0] == 200  # and the proxy serves the next client


async def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(
    tmp_path: Path,
) -> None:
    async with served(tmp_path, client_header_timeout=1.0) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        started = time.monotonic()
        assert await closed_within(reader, within=5) == b""
        assert 0.9 < time.monotonic() - started < 3.5
        writer.close()
        assert s.listening.gate.open == 0


async def test_a_keep_alive_connection_serves_requests_within_the_deadline(
    tmp_path: Path,
) -> None:
    async with served(tmp_path, client_header_timeout=1.0) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        for _ in range(3):  # three calls on one connection, 0.5 s apart: each within the deadline
            writer.write(head(length=len(BODY)) + BODY)
            status, headers, _ = await answer_of(reader)
            assert (status, headers["x-capture-status"]) == (200, "staged")
            await asyncio.sleep(0.5)
        writer.close()


# -- request bodies --------------------------------------------------------------------------


async def test_a_chat_body_slower_than_the_body_deadline_is_a_408_in_the_ledger(
    tmp_path: Path,
) -> None:
    async with served(tmp_path, client_body_timeout=1.0, client_header_timeout=30) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        started = time.monotonic()
        writer.write(head(length=len(BODY)) + BODY[:10])  # the rest never comes
        status, headers, body = await answer_of(reader, within=5)
        writer.close()
        assert status == 408
        assert 0.9 < time.monotonic() - started < 3.5
        error = orjson.loads(body)["error"]
        assert error["code"] == "body_timeout"
        assert "--client-body-timeout" in error["message"]
        assert headers["x-capture-status"] == "rejected"
        [failure] = s.failures()
        assert failure.call_id == headers["x-capture-call-id"]
        assert (failure.status, failure.http_status) == (CallStatus.REJECTED, 408)
        assert s.fake.requests == []  # nothing was forwarded


async def test_a_body_that_arrives_in_pieces_within_the_deadline_is_served(
    tmp_path: Path,
) -> None:
    async with served(tmp_path, client_body_timeout=1.5) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(head(length=len(BODY)))
        third = len(BODY) // 3 + 1
        for i in range(0, len(BODY), third):
            await asyncio.sleep(0.3)
            writer.write(BODY[i : i + third])
        status, headers, _ = await answer_of(reader)
        writer.close()
        assert (status, headers["x-capture-status"]) == (200, "staged")


@pytest.mark.parametrize("path", ["/admin/rollouts", "/tokenize"])
async def test_other_routes_answer_408_to_a_body_slower_than_the_deadline(
    tmp_path: Path, path: str
) -> None:
    async with served(
        tmp_path, client_body_timeout=1.0, client_header_timeout=30, admin_token="a" * 32
    ) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(head(path, length=100, extra=f"Authorization: Bearer {'a' * 32}\r\n") + b"{")
        status, _, body = await answer_of(reader, within=5)
        writer.close()
        assert status == 408
        assert orjson.loads(body)["error"]["code"] == "body_timeout"


async def test_the_body_deadline_does_not_cut_a_slow_handler_short(tmp_path: Path) -> None:
    # The whole body is in at once; the upstream then takes longer than the body deadline.
    async with served(tmp_path, FakeVLLM(latency=1.5), client_body_timeout=0.5) as s:
        status, headers, _ = await honest_call(s.port)
        assert (status, headers["x-capture-status"]) == (200, "staged")
        status, _, _ = await honest_call(s.port, "/tokenize")
        assert status == 200


# -- answers nobody reads --------------------------------------------------------------------


def _long_answer(request: Any) -> Turn:
    return Turn(content="y" * 10_000)


#: With 20 alternatives per token the answer is about 12 MB streamed, 10 MB as one JSON body:
#: more than the kernel's buffers on both ends hold (a loopback send buffer grows to 4 MB).
LONG = orjson.dumps({**orjson.loads(BODY), "logprobs": True, "top_logprobs": 20})
LONG_STREAM = orjson.dumps({**orjson.loads(LONG), "stream": True})


async def _connect_not_reading(port: int, request: bytes) -> socket.socket:
    """Send `request` from a client that then reads nothing: a tiny receive window, never
    drained (a plain socket: asyncio's stream reader would read ahead for it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, request)
    return sock


async def _read_all(sock: socket.socket, within: float) -> bytes:
    """What the proxy sent, read at last, until it closed the connection."""
    loop = asyncio.get_running_loop()
    out = b""
    async with asyncio.timeout(within):
        with contextlib.suppress(ConnectionResetError):
            while chunk := await loop.sock_recv(sock, 1 << 20):
                out += chunk
    sock.close()
    return out


async def _until(predicate: Any, within: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < within, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_a_stream_whose_client_stops_reading_is_cut_and_recorded_as_stalled(
    tmp_path: Path,
) -> None:
    fake = FakeVLLM(script=_long_answer)
    async with served(tmp_path, fake, client_write_timeout=1.0) as s:
        state = s.listening.app[STATE]
        sock = await _connect_not_reading(s.port, head(length=len(LONG_STREAM)) + LONG_STREAM)
        took = await _until(lambda: s.failures() != [], within=15)
        # The call is recorded as aborted by the client's stall, not left pending...
        [failure] = s.failures()
        assert (failure.status, failure.reason) == (CallStatus.ABORTED, "client_stalled")
        assert "--client-write-timeout" in failure.message
        assert took < 10
        await _until(lambda: state.capture.inflight == 0, within=5)  # the call has ended
        # ...the client finds its stream cut off: no capture status, no [DONE], then a reset.
        received = await _read_all(sock, within=5)
        assert received.startswith(b"HTTP/1.1 200")
        assert b"data: [DONE]" not in received
        assert b": capture-status" not in received
        assert s.staged() == []
        # The unread-answer backstop did not have to step in; the proxy serves the next client.
        assert s.listening.gate.dropped_unread == 0
        assert (await honest_call(s.port))[0] == 200


async def test_an_unread_answer_does_not_hold_its_connection_forever(tmp_path: Path) -> None:
    fake = FakeVLLM(script=_long_answer)
    async with served(tmp_path, fake, client_write_timeout=0.5) as s:
        sock = await _connect_not_reading(s.port, head(length=len(LONG)) + LONG)
        gate = s.listening.gate
        await _until(lambda: gate.open == 1, within=5)
        took = await _until(lambda: gate.open == 0, within=15)
        # The call was staged (the client was told so in the headers it did not read); the
        # connection it left unread was dropped after twice the write deadline.
        assert [c.call_id for c in s.staged()] != []
        assert gate.dropped_unread == 1
        assert took < 10
        received = await _read_all(sock, within=5)
        assert received.startswith(b"HTTP/1.1 200")


# -- how many connections --------------------------------------------------------------------


async def test_a_connection_over_the_cap_gets_503_with_retry_after(tmp_path: Path) -> None:
    async with served(tmp_path, max_connections=4, client_header_timeout=30) as s:
        held = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(4)]
        gate = s.listening.gate
        await _until(lambda: gate.open == 4, within=5)
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(head(length=len(BODY)) + BODY)
        status, headers, body = await answer_of(reader)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert headers["connection"] == "close"
        error = orjson.loads(body)["error"]
        assert error["code"] == "too_many_connections"
        assert "--max-connections" in error["message"]
        assert await closed_within(reader, within=3) == b""  # then the proxy closes it
        writer.close()
        assert s.fake.requests == []
        assert gate.refused == 1
        # One connection goes: the next client is served again.
        held[0][1].close()
        await _until(lambda: gate.open == 3, within=5)
        assert (await honest_call(s.port))[0] == 200
        for _, w in held[1:]:
            w.close()
        await _until(lambda: gate.open == 0, within=5)
        scrape = await honest_scrape(s.port)
        assert "capture_proxy_client_connections_refused_total 1.0" in scrape
        assert "capture_proxy_client_connections_open" in scrape


async def test_one_address_cannot_fill_the_cap_with_idle_connections(tmp_path: Path) -> None:
    # Issue 27: 4,200 idle connections from one sandbox took the whole cap, and 183 of 192
    # honest calls got 503 for the header deadline. Idle connections now count against their
    # address; one that carried a call does not (sandboxes behind one NAT share an address).
    settings: dict[str, Any] = {"max_connections": 100, "max_connections_per_address": 3}
    async with served(tmp_path, client_header_timeout=30, **settings) as s:
        gate = s.listening.gate
        idle = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(3)]
        await _until(lambda: gate.open == 3, within=5)
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(head(length=len(BODY)) + BODY)
        status, headers, body = await answer_of(reader)
        assert status == 503
        assert headers["retry-after"] == "1"
        error = orjson.loads(body)["error"]
        assert error["code"] == "too_many_connections"
        assert "--max-connections-per-address" in error["message"]
        writer.close()
        assert gate.refused_per_address == 1
        # Another address (another sandbox, or another NAT) is served meanwhile.
        other = await asyncio.open_connection("127.0.0.1", s.port, local_addr=("127.0.0.2", 0))
        other[1].write(head(length=len(BODY)) + BODY)
        assert (await answer_of(other[0]))[0] == 200
        other[1].close()
        # A connection that carried a call no longer counts: keep one open after its call.
        idle.pop()[1].close()
        await _until(lambda: gate.open == 2, within=5)
        kept = await asyncio.open_connection("127.0.0.1", s.port)
        kept[1].write(head(length=len(BODY)) + BODY)
        assert (await answer_of(kept[0]))[0] == 200
        idle.append(await asyncio.open_connection("127.0.0.1", s.port))  # 3 idle + 1 kept
        await _until(lambda: gate.open == 4, within=5)
        assert (await honest_call(s.port))[0] == 503
        for _, w in [*idle, kept]:
            w.close()
        await _until(lambda: gate.open == 0, within=5)
        assert (await honest_call(s.port))[0] == 200
        scrape = await honest_scrape(s.port)
        assert "capture_proxy_client_connections_refused_per_address_total 2.0" in scrape


async def test_an_address_opening_connections_in_a_loop_is_refused_before_its_request_is_read(
    tmp_path: Path,
) -> None:
    # Issue 27's soak: refusing a flood after parsing each request (authorizing it, writing it to
    # the ledger) kept the event loop busy and every honest call waited. A new connection over
    # its address's rate is answered at accept, before the proxy reads a byte of it.
    settings: dict[str, Any] = {"max_connection_rate_per_address": 0.1}  # one, then 1 per 10 s
    async with served(tmp_path, client_header_timeout=30, **settings) as s:
        gate = s.listening.gate
        kept = await asyncio.open_connection("127.0.0.1", s.port)
        kept[1].write(head(length=len(BODY)) + BODY)
        assert (await answer_of(kept[0]))[0] == 200
        # The next new connection from the address: the answer comes without a request sent.
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        status, headers, body = await answer_of(reader)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert headers["connection"] == "close"
        error = orjson.loads(body)["error"]
        assert error["code"] == "too_many_connections"
        assert "--max-connection-rate-per-address" in error["message"]
        assert await closed_within(reader, within=3) == b""
        writer.close()
        assert gate.refused_rate == 1
        # The connection it kept open carries calls as before, and another address is served.
        kept[1].write(head(length=len(BODY)) + BODY)
        assert (await answer_of(kept[0]))[0] == 200
        other = await asyncio.open_connection("127.0.0.1", s.port, local_addr=("127.0.0.2", 0))
        other[1].write(head(length=len(BODY)) + BODY)
        assert (await answer_of(other[0]))[0] == 200
        # Not a call: the upstream saw the three calls only, the ledger holds no refusal.
        assert len(s.fake.requests) == 3
        assert s.failures() == []
        assert len(s.staged()) == 3
        scrape = await honest_scrape(s.port, local_addr="127.0.0.3")
        assert "capture_proxy_client_connections_refused_rate_total 1.0" in scrape
        for _, w in (kept, other):
            w.close()


async def test_a_call_over_its_rollouts_in_flight_limit_gets_429_and_its_connection_closed(
    tmp_path: Path,
) -> None:
    # Issue 27's soak: a sandbox holding 1,000 keep-alive connections sent calls over its
    # rollout's in-flight limit without end, each parsed and refused. Its connection is closed
    # after the 429, so the next call comes on a new connection, judged at accept by its
    # address's rate (--max-connection-rate-per-address).
    fake = FakeVLLM(latency=2.0)
    async with served(tmp_path, fake, max_inflight_per_rollout=1) as s:
        busy = asyncio.create_task(honest_call(s.port))
        await _until(lambda: len(fake.requests) == 1, within=10)
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(head(length=len(BODY)) + BODY)
        status, headers, body = await answer_of(reader)
        assert status == 429
        assert headers["connection"] == "close"
        assert orjson.loads(body)["error"]["code"] == "too_many_inflight_rollout"
        assert headers["x-capture-status"] == "rejected"
        assert await closed_within(reader, within=3) == b""
        writer.close()
        assert (await busy)[0] == 200
        # Refused, and in the ledger; the first call staged. Nothing else was forwarded.
        assert [f.reason for f in s.failures()] == ["too_many_inflight_rollout"]
        assert len(s.staged()) == 1
        assert len(fake.requests) == 1


async def honest_scrape(port: int, local_addr: str = "127.0.0.1") -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local_addr, 0))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: proxy\r\n\r\n")
    try:
        return (await answer_of(reader))[2].decode()
    finally:
        writer.close()


async def test_the_cap_is_lowered_to_what_the_open_file_limit_allows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeVLLM()
    upstream = TestServer(fake.app())
    await upstream.start_server()
    settings = Settings(
        upstream=str(upstream.make_url("")).rstrip("/"),
        store=f"sqlite:///{tmp_path / 's.db'}",
        port=0,
        min_free_disk_mb=0,
    )
    with caplog.at_level(logging.WARNING, logger="capture_proxy"):
        listening = await listen(settings, open_files=1024)
    try:
        assert listening.gate.limit == connection_budget(1024) == 408
        assert "--max-connections 4096 lowered to 408" in caplog.text
    finally:
        await listening.close()
        await upstream.close()
