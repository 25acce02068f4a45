"""A lean pooled HTTP/1.1 client for token-in's requests (render, generate, derender).

A bridged token-in call makes seven JSON round trips where a plain call makes one; through
aiohttp's client each cost about 95 µs of the event loop's CPU on loopback, over three times what
the same request costs here (docs/reports/performance.md, "Third cuts"). The protocol is
asyncio's transport with `httptools` (llhttp, the parser Node.js uses) reading the answer: bytes
in, callbacks out, no awaits.

`RpcPool.post` returns an `RpcReply` once the answer's status line and headers are in; its
`read` gives the whole body, `chunks` the body as it arrives (a streamed generate). The timeouts
and errors are `HTTPUpstream`'s (the same codes, statuses and messages' start):
`upstream_connect_timeout` (504) and `upstream_unreachable` when no connection could be made,
`upstream_timeout` (504) when no answer began within the first-byte timeout, `upstream_broken`
when the answer broke off (or, read whole, stalled for the idle timeout),
`upstream_idle_timeout` when a stream sent nothing for the idle timeout, `upstream_deadline`
(504) past the call's total timeout. Closing a reply before its end closes its connection (vLLM
aborts a generation whose client went away). A connection is reused when the answer
allows it (keep-alive, read whole); idle ones are closed after `KEEPALIVE_S` (4 s, under
vLLM's 5 s), as the chat pool's are. There is no limit on connections, as in the chat pool.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from ..errors import UpstreamFailed
from .read_watch import ReadWatch, past_deadline

__all__ = ["KEEPALIVE_S", "RpcPool", "RpcReply"]

#: How long an idle pooled connection is kept: under vLLM's own keep-alive (uvicorn's, 5 s by
#: default, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), so the proxy closes an idle connection before the
#: server does. Kept longer, a request written on a connection the server is closing at that
#: moment fails as ``upstream_unreachable`` (seen once against the real vLLM under load).
KEEPALIVE_S = 4.0


class _Conn(asyncio.Protocol):
    """One connection: feeds the answer's bytes to the parser, wakes the reader on progress."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.lost: BaseException | None = None
        self.closed = False
        self.until_eof = False  # an answer with neither Content-Length nor chunked
        #: A read of the whole body waits: woken at its end only, each chunk noted by `watch`.
        self.whole = False
        self.watch: ReadWatch | None = None
        self.timed_out = False  # no answer began within the first-byte timeout
        self._framed = False
        self._wake: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self.keep_alive = False

    # -- asyncio --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not `asyncio.Transport` subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.lost = exc
            self._close()
        if self.whole and not self.complete and self.lost is None:
            # The reader wants the whole body: a chunk only restarts its idle timeout.
            watch = self.watch
            if watch is not None:
                watch.waiting_since = watch.loop.time()
            return
        self._wakeup()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.headers_done and self.until_eof and not self.complete:
            self.complete = True  # the answer ends with the connection
        elif not self.complete and self.lost is None:
            self.lost = exc or ConnectionResetError("the upstream closed the connection")
        self._wakeup()

    # -- httptools ------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length" or (
            lower == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.until_eof = not self._framed

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked now: the parser forgets the answer's keep-alive once it has returned.
        self.keep_alive = self.parser.should_keep_alive()

    # -- for the reply --------------------------------------------------------------------
    def start(self, request: tuple[bytes, bytes]) -> None:
        """Send one request on this (idle) connection."""
        self.parser = httptools.HttpResponseParser(self)
        self.body = []
        self.headers_done = self.complete = self._framed = self.until_eof = False
        self.keep_alive = self.whole = self.timed_out = False
        self.watch = None
        assert self.transport is not None
        self.transport.writelines(request)

    async def progress(self) -> None:
        """Wait for more of the answer (or its end, or the connection's)."""
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    def time_out(self) -> None:
        """The first-byte timeout passed: wake the waiting request."""
        self.timed_out = True
        self._wakeup()

    def _wakeup(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed


class RpcPool:
    """Pooled connections to the upstream at `base_url`, for whole JSON answers.

    `headers` go with every request (the API key). `on_new`, when given, is awaited on each new
    connection before a request to one of `watched` paths is written on it (the check for a
    restarted upstream, as `capture_proxy.upstream.connector.WatchedConnector` does for aiohttp's
    pool); if it raises, the connection is closed and the error goes to the caller.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: dict[str, str] | None = None,
        connect_timeout: float = 10.0,
        on_new: Callable[[], Awaitable[None]] | None = None,
        watched: tuple[str, ...] = (),
    ) -> None:
        url = urlsplit(base_url)
        self.host = url.hostname or "127.0.0.1"
        self._ssl = url.scheme == "https"
        self.port = url.port or (443 if self._ssl else 80)
        self.connect_timeout = connect_timeout
        host = self.host if url.port is None else f"{self.host}:{self.port}"
        if ":" in self.host and not self.host.startswith("["):
            host = f"[{self.host}]" if url.port is None else f"[{self.host}]:{self.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {host}\r\n{extra}Content-Type: application/json\r\n"
        self._on_new = on_new
        self._watched = watched
        self._idle: list[_Conn] = []
        self._ssl_context: ssl.SSLContext | None = None

    async def post(
        self,
        path: str,
        body: bytes,
        *,
        first_byte: float,
        idle: float,
        deadline: float | None = None,
        total: float = 0.0,
    ) -> RpcReply:
        """POST `body` (JSON) to `path`; the reply once its headers are in. Timeouts in
        seconds; `deadline` in loop time (None: none), `total` the setting it came from."""
        conn = await self._connection(path)
        head = f"POST {path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n"
        conn.start((head.encode("latin-1"), body))
        # One timer handle, not `asyncio.timeout()`'s context: a few µs less per request.
        timer = asyncio.get_running_loop().call_later(first_byte, conn.time_out)
        try:
            while not conn.headers_done:
                if conn.lost is not None:
                    raise _unreachable(conn.lost)
                if conn.timed_out:
                    raise UpstreamFailed(
                        f"the upstream sent no response within {first_byte:g}s",
                        code="upstream_timeout",
                        status=504,
                    ) from TimeoutError()  # the cause `asyncio.timeout` would give
                await conn.progress()
        except BaseException:
            conn._close()
            raise
        finally:
            timer.cancel()
        return RpcReply(self, conn, idle, deadline, total)

    async def _connection(self, path: str) -> _Conn:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn._close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    _Conn, self.host, self.port, ssl=self._context()
                )
        except TimeoutError as exc:
            raise UpstreamFailed(
                f"could not connect to the upstream within {self.connect_timeout:g}s "
                "(--upstream-connect-timeout)",
                code="upstream_connect_timeout",
                status=504,
            ) from exc
        except OSError as exc:
            raise _unreachable(exc) from exc
        if self._on_new is not None and path.endswith(self._watched):
            try:
                await self._on_new()
            except BaseException:
                conn._close()
                raise
        return conn

    def _context(self) -> ssl.SSLContext | None:
        if not self._ssl:
            return None
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    def _release(self, conn: _Conn) -> None:
        if conn.reusable:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn._close()

    def close(self) -> None:
        """Close the idle connections (one in use is closed when its reply is done)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn._close()


def _unreachable(exc: BaseException) -> UpstreamFailed:
    failed = UpstreamFailed(
        f"cannot reach the upstream: {type(exc).__name__}: {exc}", code="upstream_unreachable"
    )
    failed.__cause__ = exc
    return failed


def _broken(what: str, lost: BaseException) -> UpstreamFailed:
    """`upstream_broken`: the connection was lost (`lost`) before the answer's end."""
    return UpstreamFailed(f"{what}: {type(lost).__name__}: {lost}", code="upstream_broken")


class RpcReply:
    """An `capture_proxy.core.transport.UpstreamReply` of `RpcPool`: `read` gives the whole
    body (kept: a second `read` gives it again); the connection goes back to the pool once the
    answer is read whole, and is closed when the reply is left before that."""

    def __init__(
        self, pool: RpcPool, conn: _Conn, idle: float, deadline: float | None, total: float
    ) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self._idle = idle
        self._deadline = deadline
        self._total = total
        self._body: bytes | None = None
        self.status: int = conn.parser.get_status_code()

    async def __aenter__(self) -> RpcReply:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn._close()

    async def read(self) -> bytes:
        if self._body is not None:
            return self._body
        conn = self._conn
        if conn is None:
            raise UpstreamFailed(
                "the upstream answer broke off: the reply was closed", code="upstream_broken"
            )
        watch: ReadWatch | None = None
        try:
            while not conn.complete:
                if conn.lost is not None:
                    self.close()
                    raise _broken("the upstream answer broke off", conn.lost) from conn.lost
                if watch is None:
                    # One timer for the whole body (the idle timeout restarted by each chunk,
                    # the deadline), and the reader woken once, at its end: not a timer and a
                    # wake-up per chunk.
                    watch = ReadWatch(self._idle, self._deadline, lambda _kind: conn._wakeup())
                    watch.waiting_since = watch.loop.time()
                    conn.watch, conn.whole = watch, True
                elif watch.expired is not None:
                    self.close()
                    if watch.expired == "deadline":
                        raise past_deadline(self._total) from TimeoutError()
                    raise UpstreamFailed(
                        "the upstream answer broke off: TimeoutError: ", code="upstream_broken"
                    ) from TimeoutError()
                await conn.progress()
        finally:
            if watch is not None:
                watch.stop()
                conn.watch, conn.whole = None, False
        self._body = b"".join(conn.body)
        conn.body = []
        self._conn = None
        self._pool._release(conn)
        return self._body

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (a streamed generate). The idle timeout counts only while a
        read waits (not while the caller handles a chunk), checked by one timer for the whole
        stream rather than one per read (`capture_proxy.upstream.read_watch.ReadWatch`)."""
        if self._body is not None:
            if self._body:
                yield self._body
            return
        conn = self._conn
        if conn is None:
            return
        watch = ReadWatch(self._idle, self._deadline, lambda _kind: conn._wakeup())
        try:
            while True:
                if conn.body:
                    data = conn.body[0] if len(conn.body) == 1 else b"".join(conn.body)
                    conn.body = []
                    yield data
                    continue
                if conn.complete:
                    self._conn = None
                    self._pool._release(conn)
                    return
                if watch.expired is not None:
                    self.close()
                    if watch.expired == "deadline":
                        raise past_deadline(self._total)
                    raise UpstreamFailed(
                        f"the upstream sent nothing for {self._idle:g}s mid-stream",
                        code="upstream_idle_timeout",
                    )
                if conn.lost is not None:
                    self.close()
                    raise _broken("the upstream stream broke", conn.lost) from conn.lost
                now = watch.loop.time()
                if self._deadline is not None and now >= self._deadline:
                    watch.expired = "deadline"
                    continue
                watch.waiting_since = now
                await conn.progress()
                watch.waiting_since = None
        finally:
            watch.stop()
