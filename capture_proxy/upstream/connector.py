"""A connection pool that lets the upstream check a new connection before a chat call uses it.

A server restart closes every connection, so a call on a pooled connection reaches the process
its facts came from; only a call on a new connection may reach another one. `WatchedConnector`
runs a check (`on_new`) once per new connection opened for a call (the chat route, or the render
and generate routes a token-in call starts with), after the connection is made and before the
request is written: the steady state (connections reused) costs a set lookup.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

__all__ = ["WATCHED_PATHS", "WatchedConnector"]

#: The routes a call is planned for: chat, and token-in's render and generate (derender only
#: reads an answer already generated; a new process answers it the same).
WATCHED_PATHS = ("/v1/chat/completions", "/v1/chat/completions/render", "/inference/v1/generate")


class WatchedConnector(aiohttp.TCPConnector):
    """A `TCPConnector` that awaits `on_new()` when a call gets a connection it has not seen.

    If `on_new` raises, the new connection is closed and the error goes to the caller of the
    request, which was not sent.
    """

    def __init__(self, on_new: Callable[[], Awaitable[None]], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._on_new = on_new
        self._seen: weakref.WeakSet[object] = weakref.WeakSet()

    # aiohttp's own signature, timeout parameter included.
    async def connect(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109
    ) -> Connection:
        conn = await super().connect(req, traces, timeout)
        proto = conn.protocol
        if proto is None or proto in self._seen:
            return conn
        self._seen.add(proto)
        if req.method == "POST" and req.url.path.endswith(WATCHED_PATHS):
            try:
                await self._on_new()
            except BaseException:
                conn.close()
                raise
        return conn
