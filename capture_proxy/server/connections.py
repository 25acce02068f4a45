"""Client connections: how many may be open, and how long an answer may go unread.

Sandboxes run model-written code, and every connection holds a file descriptor. Without a cap a
flood of connections (or 700 honest calls under a 1,024 descriptor limit) runs the process out of
descriptors, and then nothing works: not the upstream, not the store, not even ``accept``. So
`ConnectionGate` wraps the protocol aiohttp builds for each accepted connection and:

- refuses a connection over the cap at once with a complete answer, ``503`` + ``Retry-After`` in
  the OpenAI error form, without reading its request (clients such as the OpenAI SDK retry it);
  the connection is half-closed and dropped a second later, so the client reads the answer
  instead of a reset;
- refuses the same way a connection from an address that already holds `per_address` connections
  that have not yet carried an authorized call (``--max-connections-per-address``): one sandbox
  opening thousands of idle connections filled the whole cap, and every other sandbox got 503
  for the header deadline. Sandboxes behind one NAT share an address, so a connection stops
  counting against its address once it has carried a call the proxy authorized (with a rollout's
  key, where keys are required): past that point the per-rollout limits judge it;
- refuses the same way a new connection from an address that opened more than
  `rate_per_address` a second (``--max-connection-rate-per-address``, a token bucket with twice
  that saved up): a sandbox that opens, uses and drops connections in a loop is refused at accept,
  before a byte of its request is parsed, where each refusal costs the event loop a few
  microseconds instead of a request's parsing, authorization and ledger row. A new connection has
  carried no authorized call yet, so this is a limit per address before authentication, sized for
  the sandboxes of one NAT keeping their connections open;
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
import time
from collections import OrderedDict
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
#: Seconds between two log lines of one kind of refused connection (see `_log_refusal`).
_LOG_EVERY_S = 10.0
#: Addresses whose connection buckets are remembered; the least recently seen are forgotten past
#: it (a forgotten address starts with a full bucket: one burst more at most).
_RATE_REMEMBERED = 65_536


def _refusal_answer(message: str) -> bytes:
    """The whole HTTP answer a refused connection gets."""
    body = error_body(message, type="capture_unavailable", code="too_many_connections")
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

    def __init__(
        self,
        *,
        limit: int,
        unread_timeout: float,
        per_address: int = 0,
        rate_per_address: float = 0.0,
    ) -> None:
        self.limit = limit
        self.per_address = per_address
        self.rate_per_address = rate_per_address
        #: New connections an address may open at once after a quiet spell.
        self.burst_per_address = max(1.0, 2 * rate_per_address)
        self.unread_timeout = unread_timeout
        self.open = 0
        self.refused = 0
        self.refused_per_address = 0
        self.refused_rate = 0
        self.dropped_unread = 0
        self.lingering = 0
        self.refusal = _refusal_answer(
            f"capture-proxy is at its connection limit ({limit} open, --max-connections): retry"
        )
        self.address_refusal = _refusal_answer(
            f"this address holds {per_address} connections that have carried no authorized "
            "call yet (--max-connections-per-address): retry"
        )
        self.rate_refusal = _refusal_answer(
            f"this address opens new connections faster than {rate_per_address:g} a second "
            "(--max-connection-rate-per-address): keep connections open, or retry"
        )
        #: Per kind of refusal (its log message): [when its last line was logged, refusals
        #: since not logged, the limit the message names].
        self._log_windows: dict[str, list[float]] = {}
        #: Per address: (new connections it may still open, when that was reckoned).
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        #: Connections not yet proven (see the module docs), by the transport they came on.
        self._unproven: dict[int, str] = {}
        self._per_address: dict[str, int] = {}

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Gated(self, factory)

    def prove(self, transport: object) -> None:
        """The connection on `transport` carried an authorized call: it stops counting against
        its address (called by the handlers once a call is authorized)."""
        address = self._unproven.pop(id(transport), None)
        if address is not None:
            self._forget(address)

    def take_rate(self, address: str) -> bool:
        """Take one new connection from the address's bucket; False if it is empty."""
        if self.rate_per_address <= 0:
            return True
        now = time.monotonic()
        level, at = self._buckets.pop(address, (self.burst_per_address, now))
        level = min(self.burst_per_address, level + (now - at) * self.rate_per_address)
        taken = level >= 1.0
        self._buckets[address] = (level - 1.0 if taken else level, now)
        if len(self._buckets) > _RATE_REMEMBERED:
            self._buckets.popitem(last=False)
        return taken

    def take_address(self, transport: asyncio.Transport, address: str | None) -> bool:
        """Count a new connection against its address; False if the address is at its cap."""
        if not self.per_address or address is None:
            return True  # no cap, or a Unix socket: no address to tell clients apart by
        held = self._per_address.get(address, 0)
        if held >= self.per_address:
            return False
        self._per_address[address] = held + 1
        self._unproven[id(transport)] = address
        return True

    def release(self, transport: asyncio.Transport) -> None:
        """A connection closed: it no longer counts against its address, if it did."""
        address = self._unproven.pop(id(transport), None)
        if address is not None:
            self._forget(address)

    def _forget(self, address: str) -> None:
        left = self._per_address[address] - 1
        if left:
            self._per_address[address] = left
        else:
            del self._per_address[address]

    def _log_refusal(self, why: str, limit: float) -> None:
        """One line per kind of refusal per `_LOG_EVERY_S`, the refusals between counted in the
        next (or in `flush_log`). Logging every one cost 10-20 µs (a record, the caller's
        frame, the log's lock), a third of a refusal's cost at accept, though the log's repeat
        filter then dropped all but a few."""
        now = time.monotonic()
        window = self._log_windows.get(why)
        if window is not None and now - window[0] < _LOG_EVERY_S:
            window[1] += 1
            return
        held = int(window[1]) if window is not None else 0
        self._log_windows[why] = [now, 0, limit]
        if held:
            log.warning(
                "refused a client connection: " + why + " [%d more like this not logged]",
                limit,
                held,
            )
        else:
            log.warning("refused a client connection: " + why, limit)

    def flush_log(self, *, all_windows: bool = False) -> None:
        """Log how many refusals of each kind went unlogged in an interval that has ended (in
        every one with `all_windows`, as at exit): a storm that stops is still counted.
        ``capture-proxy serve`` calls it with the log's own flush."""
        now = time.monotonic()
        for why, window in self._log_windows.items():
            logged_at, held, limit = window
            if held and (all_windows or now - logged_at >= _LOG_EVERY_S):
                log.warning(
                    "%d more like this not logged in %.0fs: refused a client connection: " + why,
                    held,
                    now - logged_at,
                    limit,
                )
                window[:] = [now, 0, limit]

    def stats(self) -> dict[str, float]:
        return {
            "client_connections_open": self.open,
            "client_connections_refused_total": self.refused,
            "client_connections_refused_per_address_total": self.refused_per_address,
            "client_connections_refused_rate_total": self.refused_rate,
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
            self._refuse(transport, gate.refusal, "%d open, the limit (--max-connections)")
            return
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) else None
        if address is not None and not gate.take_rate(address):
            gate.refused_rate += 1
            self._refuse(
                transport,
                gate.rate_refusal,
                "its address opens more than %g a second (--max-connection-rate-per-address)",
            )
            return
        if not gate.take_address(transport, address):
            gate.refused_per_address += 1
            self._refuse(
                transport,
                gate.address_refusal,
                "its address holds %d without an authorized call (--max-connections-per-address)",
            )
            return
        gate.open += 1
        self._inner = self._factory()
        self._inner.connection_made(transport)

    def _refuse(self, transport: asyncio.Transport, answer: bytes, why: str) -> None:
        gate = self._gate
        gate.refused += 1
        self._refused = True
        limit: float = gate.per_address
        if answer is gate.refusal:
            limit = gate.limit
        elif answer is gate.rate_refusal:
            limit = gate.rate_per_address
        gate._log_refusal(why, limit)
        transport.write(answer)
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
        transport, self._transport = self._transport, None
        if self._refused:
            if self._lingers:
                self._gate.lingering -= 1
            return
        if self._inner is not None:
            self._gate.open -= 1
            if transport is not None:
                self._gate.release(transport)
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)
