"""A loopback TCP relay that counts the bytes clients send an HTTP server, request by request.

Put between a proxy and vLLM (`ByteRelay`), it keeps each request's path, head (request line and
headers) and ``Content-Length`` body as they went, and relays the answers unchanged: what a
call cost upstream, whatever client sent it. `request_kind` names what a request is for (the
chat call, the request's own render, a dummy render of the bridge, generate, a derender call).
Used by tests/e2e/test_vllm_upstream_bytes.py, bench/bench_token_in_vllm.py and
bench/bench_token_in_render_wait.py (which reads the times).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

import orjson

__all__ = ["ByteRelay", "Sent", "by_kind", "request_kind"]


@dataclass(slots=True)
class Sent:
    """One request as it went through the relay: `sent` when it left (``time.perf_counter``),
    `answered` when the last byte of its answer so far came back (0.0: none yet)."""

    path: str
    head: bytes
    body: bytes
    sent: float = 0.0
    answered: float = 0.0

    @property
    def size(self) -> int:
        return len(self.head) + len(self.body)


class ByteRelay:
    """Relays loopback connections to ``127.0.0.1:port`` and logs every request (`log`).

    ``await start()`` gives the port to connect to; ``await close()`` stops it. Requests must
    have a ``Content-Length`` body (or none): what an HTTP/1.1 client posting JSON sends."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.log: list[Sent] = []
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def since(self, mark: int) -> list[Sent]:
        """The requests logged after the first `mark` (``len(log)`` taken before)."""
        return self.log[mark:]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        #: This connection's requests: an answer belongs to the latest (HTTP/1.1, one at a time).
        mine: list[Sent] = []

        async def requests() -> None:
            try:
                while head := await reader.readuntil(b"\r\n\r\n"):
                    path = head.split(b" ", 2)[1].split(b"?")[0].decode()
                    size = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            size = int(line.split(b":")[1])
                    body = await reader.readexactly(size)
                    sent = Sent(path, head, body, time.perf_counter())
                    self.log.append(sent)
                    mine.append(sent)
                    up_writer.write(head + body)
                    await up_writer.drain()
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                up_writer.close()

        async def answers() -> None:
            try:
                while data := await up_reader.read(1 << 16):
                    if mine:
                        mine[-1].answered = time.perf_counter()
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(requests(), answers(), return_exceptions=True)
        except asyncio.CancelledError:
            # The loop is ending with this connection open (a kept-alive client's): asyncio's
            # stream callback would log a cancelled handler as an error, so end quietly.
            pass
        finally:
            self._writers -= {writer, up_writer}

    async def close(self) -> None:
        """Stop accepting, and close the connections still open (both ends)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()


def request_kind(sent: Sent, messages: int) -> str:
    """What `sent` is for: ``chat``, ``render: the request`` (a render of `messages` messages,
    the call's own), ``render: dummy`` (the bridge's), ``generate``, ``derender: unary``,
    ``derender: stream chunk``, or its path."""
    if sent.path.endswith("/chat/completions/render"):
        own = len(orjson.loads(sent.body).get("messages") or ()) == messages
        return "render: the request" if own else "render: dummy"
    if sent.path.endswith("/chat/completions/derender"):
        streamed = orjson.loads(sent.body).get("stream")
        return "derender: stream chunk" if streamed else "derender: unary"
    return {"/v1/chat/completions": "chat", "/inference/v1/generate": "generate"}.get(
        sent.path, sent.path
    )


def by_kind(log: list[Sent], messages: int) -> dict[str, tuple[int, int, int]]:
    """Per `request_kind`: how many requests, the bytes of their heads and of their bodies."""
    kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for sent in log:
        kind = kinds[request_kind(sent, messages)]
        kind[0] += 1
        kind[1] += len(sent.head)
        kind[2] += len(sent.body)
    return {k: (n, h, b) for k, (n, h, b) in kinds.items()}
