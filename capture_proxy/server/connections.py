"""Client connections: how many may be open, and how long an answer may go unread.

Sandboxes run model-written code, and every connection holds a file descriptor. Without a cap a
flood of connections (or 700 honest calls under a 1,024 descriptor limit) runs the process out of
descriptors, and then nothing works: not the upstream, not the store, not even ``accept``. So
`ConnectionGate` wraps the protocol aiohttp builds for each accepted connection and:

- refuses a connection over the cap at once with a complete answer, ``503`` + ``Retry-After`` in
  the OpenAI error form, without reading its request (clients such as the OpenAI SDK retry it);
  the connection is half-closed and dropped a second later, so the client reads the answer
  instead of a reset;
- drops a connection whose client leaves its answer unread (the transport's buffer full, writing
  paused) for `unread_timeout` (``server.run``: twice ``--client-write-timeout``): nothing else
  frees a connection held that way. A stream enforces the write deadline itself and records its
  call as stalled (`server.chat`); this is the backstop for every other answer.

Deadlines on reading requests are aiohttp's (the header deadline) and the handlers' (the body
deadline); ``server.run`` puts them together.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

from ..errors import error_body

__all__ = ["MAX_LINGERING", "ConnectionGate"]

log = logging.getLogger("capture_proxy.connections")

#: How long a refused connection is kept half-closed so its client can read the 503.
_LINGER_S = 1.0
#: Refused connections kept lingering at once; beyond it they are closed at once (a flood).
#: ``server.run`` keeps descriptors for them.
MAX_LINGERING = 16


def _refusal_answer(limit: int) -> bytes:
    """The whole HTTP answer a connection over the cap gets."""
    body = error_body(
        f"capture-proxy is at its connection limit ({limit} open, --max-connections): retry",
        type="capture_unavailable",
        code="too_many_connections",
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGate:
    """Counts a listener's connections, refuses those over `limit`, drops unread ones.

    ``loop.create_server(gate.wrap(runner.server), ...)``: every accepted connection gets a
    `_Gated` protocol, which hands the connection to aiohttp's own protocol when it is admitted.
    `limit` 0 admits every connection. `stats` feeds ``/metrics``.
    """

    def __init__(self, *, limit: int, unread_timeout: float) -> None:
        self.limit = limit
        self.unread_timeout = unread_timeout
        self.open = 0
        self.refused = 0
        self.dropped_unread = 0
        self.lingering = 0
        self.refusal = _refusal_answer(limit)

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Gated(self, factory)

    def stats(self) -> dict[str, float]:
        return {
            "client_connections_open": self.open,
            "client_connections_refused_total": self.refused,
            "client_connections_dropped_unread_total": self.dropped_unread,
        }


class _Gated(asyncio.Protocol):
    """One connection: aiohttp's protocol behind a cap and an unread-answer deadline.

    Every transport callback is passed on to the inner protocol, so aiohttp sees the connection
    exactly as if it had accepted it itself (aiohttp never asks the transport for its protocol).
    """

    __slots__ = ("_factory", "_gate", "_inner", "_lingers", "_refused", "_timer", "_transport")

    def __init__(self, gate: ConnectionGate, factory: Callable[[], asyncio.Protocol]) -> None:
        self._gate = gate
        self._factory = factory
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._lingers = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: asyncio's own, or uvloop's (`--loop`), which has the same methods
        # but does not derive from asyncio.Transport.
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        gate = self._gate
        if gate.limit and gate.open >= gate.limit:
            self._refuse(transport)
            return
        gate.open += 1
        self._inner = self._factory()
        self._inner.connection_made(transport)

    def _refuse(self, transport: asyncio.Transport) -> None:
        gate = self._gate
        gate.refused += 1
        self._refused = True
        # One line per kind per interval: the log's repeat filter (capture_proxy.logs) folds a
        # flood of refusals into a count.
        log.warning(
            "refused a client connection: %d open, the limit (--max-connections)", gate.limit
        )
        transport.write(gate.refusal)
        if gate.lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        # Half-close and keep reading (and discarding) what the client sends, so its request
        # does not turn our close into a reset that would hide the 503 from it.
        transport.write_eof()
        gate.lingering += 1
        self._lingers = True
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            return self._inner.eof_received()
        return None  # a refused connection: the client has read the answer, close it

    def pause_writing(self) -> None:
        if self._inner is None:
            return
        # The client stopped reading: the kernel's buffers and the transport's are full.
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._gate.unread_timeout, self._drop_unread)
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._inner is not None:
            self._inner.resume_writing()

    def _drop_unread(self) -> None:
        self._timer = None
        self._gate.dropped_unread += 1
        log.warning(
            "closed a client connection whose answer went unread for %gs",
            self._gate.unread_timeout,
        )
        if self._transport is not None:
            self._transport.abort()  # unsent bytes are dropped: close() would wait for them

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None
        if self._refused:
            if self._lingers:
                self._gate.lingering -= 1
            return
        if self._inner is not None:
            self._gate.open -= 1
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)
