"""``capture-proxy serve``: run the application on its sockets until a signal stops it.

Start-up raises the soft open-file limit to the hard one (every connection is a descriptor) and
sizes the connection cap to what that limit allows. The listeners put a `ConnectionGate` in front
of aiohttp's protocol (the cap, and the deadline on answers nobody reads); aiohttp's keep-alive
timer is the deadline on request heads (it closes a connection that has not sent a whole request
head that long after it opened or after its previous answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
import sys
from dataclasses import dataclass, field

from aiohttp import web

from ..logs import flush_repeats
from . import huge_pages
from .app import create_admin_app, create_app
from .collector import tune_for_serving
from .connections import MAX_LINGERING, ConnectionGate
from .event_loop import loop_name
from .heap_trim import HeapTrim, arrow_on_malloc, fix_mmap_threshold, limit_arenas
from .settings import Settings
from .state import STATE

__all__ = ["Listening", "connection_budget", "listen", "raise_open_file_limit", "serve"]

log = logging.getLogger("capture_proxy")

#: Descriptors kept for everything but admitted client connections: the store (SQLite's file,
#: WAL and index, readers; Parquet files), the listeners, logs, the event loop, imports (64);
#: connections accepted in one go before any is refused (asyncio accepts up to the listen
#: backlog, 128, per wake-up); refused connections kept open while their 503 is read (16).
_RESERVED_FDS = 64 + 128 + MAX_LINGERING
#: Seconds a connection is kept after an answer while its request body is still coming: aiohttp
#: waits 10 s by default, and refused bodies of a flood held that many connections open.
_LINGER_S = 1.0
#: Connections the control API's port takes at once (rollout drivers, not sandboxes).
_ADMIN_CONNECTIONS = 256


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (logged); return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 2**20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        log.info("open-file limit %s (the hard limit)", soft)
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
        return soft
    log.info("open-file limit raised from %d to %d (the hard limit)", soft, target)
    return target


def connection_budget(open_files: int) -> int:
    """Client connections the descriptors allow: each call holds its client's connection and
    one to the upstream, and some descriptors are kept for the rest (`_RESERVED_FDS`).
    1,024 descriptors take 408 connections; 65,536 take 32,664."""
    if open_files == resource.RLIM_INFINITY:
        return 2**31
    return max(8, (open_files - _RESERVED_FDS) // 2)


@dataclass
class Listening:
    """The proxy's listeners and runners, as `serve` starts them (tests start them the same way)."""

    app: web.Application
    runner: web.AppRunner
    url: str
    gate: ConnectionGate
    servers: list[asyncio.Server] = field(default_factory=list)
    admin_runner: web.AppRunner | None = None
    admin_url: str = ""

    async def close(self) -> None:
        """Stop accepting, let calls in flight finish (``shutdown_timeout``), close the app."""
        for server in self.servers:
            server.close()  # what aiohttp's site.stop() does: the listening socket goes
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
        await self.runner.cleanup()


def _runner(app: web.Application, settings: Settings) -> web.AppRunner:
    # The keep-alive timer is aiohttp's only deadline on reading a request head: it closes a
    # connection that has not sent a whole head this long after it opened or after its last
    # answer (partial heads included). Handlers run with cancellation, so a client that goes
    # away stops its call.
    # aiohttp keeps a connection whose request body a handler left unread until the rest of
    # it arrives, for up to `lingering_time`: a refused body it can keep the connection for is
    # read and parsed to be discarded, and one the chat route cut (`server.chat._unread_rest`)
    # waits this long for its client to read the answer and close, then is closed.
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=settings.client_header_timeout,
        shutdown_timeout=settings.shutdown_timeout,
        lingering_time=_LINGER_S,
    )


async def _listen_on(
    runner: web.AppRunner, host: str, port: int, gate: ConnectionGate
) -> asyncio.Server:
    assert runner.server is not None
    loop = asyncio.get_running_loop()
    return await loop.create_server(gate.wrap(runner.server), host, port)


async def listen(
    settings: Settings, app: web.Application | None = None, *, open_files: int | None = None
) -> Listening:
    """Start the proxy's listener (and the control API's, with ``--admin-port``).

    `open_files` is the process's open-file limit, which lowers the connection cap when it cannot
    hold ``--max-connections`` connections (default: the current soft limit).
    """
    app = app if app is not None else create_app(settings)
    if open_files is None:
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    budget = connection_budget(open_files)
    cap = settings.max_connections
    if cap and cap > budget:
        log.warning(
            "--max-connections %d lowered to %d: the open-file limit is %d (each call needs two "
            "descriptors; raise LimitNOFILE / ulimit -n to take more)",
            cap,
            budget,
            open_files,
        )
        cap = budget
    runner = _runner(app, settings)
    await runner.setup()
    unread = 2 * settings.client_write_timeout
    gate = ConnectionGate(
        limit=cap,
        unread_timeout=unread,
        per_address=settings.max_connections_per_address,
        rate_per_address=settings.max_connection_rate_per_address,
    )
    app[STATE].connections = gate
    server = await _listen_on(runner, settings.host, settings.port, gate)
    host, port = server.sockets[0].getsockname()[:2]
    listening = Listening(app, runner, f"http://{host}:{port}", gate, [server])
    app[STATE].listen_url = listening.url
    app[STATE].metrics.add_live(gate.stats)
    log.info(
        "taking up to %s client connections (--max-connections %d, open-file limit %d)",
        cap or "unlimited",
        settings.max_connections,
        open_files,
    )
    if settings.admin_token and settings.admin_port:
        admin_runner = _runner(create_admin_app(app), settings)
        await admin_runner.setup()
        admin_gate = ConnectionGate(
            limit=min(_ADMIN_CONNECTIONS, max(8, budget // 4)), unread_timeout=unread
        )
        admin_host = settings.admin_host or settings.host
        admin_server = await _listen_on(admin_runner, admin_host, settings.admin_port, admin_gate)
        listening.servers.append(admin_server)
        listening.admin_runner = admin_runner
        listening.admin_url = f"http://{admin_host}:{admin_server.sockets[0].getsockname()[1]}"
    return listening


async def _flush_logs_repeatedly(gate: ConnectionGate) -> None:
    """Storms of one kind of warning are logged as counts (capture_proxy.logs.RepeatFilter, and
    the connection gate's own for refused connections)."""
    while True:
        await asyncio.sleep(10.0)
        gate.flush_log()
        flush_repeats()


async def serve(settings: Settings) -> int:
    """Serve the proxy (and the control API on its own port, if set) until SIGINT or SIGTERM.

    Returns the exit status: 1 when ledger entries could not be written to the store and were
    spilled to the ledger journal (or stderr) instead, else 0."""
    # Signals first: a SIGTERM that arrives while starting (or right after the banner, which is
    # how supervisors and tests see readiness) stops the proxy cleanly instead of killing it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    huge_pages.apply(settings.transparent_huge_pages)
    if not fix_mmap_threshold():
        log.info("this C library has no mallopt: large buffers are left to its own threshold")
    limit_arenas()  # before the store's and the loop's threads start (heap_trim says why)
    arrow_on_malloc()  # before the store imports pyarrow (heap_trim says why)
    open_files = raise_open_file_limit()
    listening = await listen(settings, open_files=open_files)
    state = listening.app[STATE]
    tune_for_serving()  # start-up is done: what it built lives as long as the process
    # The banner is for people and readiness probes: stderr, beside the logs, so stdout carries
    # nothing a pipeline could mistake for output.
    print(
        f"capture-proxy listening on {state.listen_url} -> upstream {state.upstream_url}, "
        f"store {settings.store}",
        file=sys.stderr,
        flush=True,
    )
    print(
        f"  point OpenAI clients at {state.listen_url}/r/<rollout-id>/v1 ; "
        f"inspect with: capture-proxy inspect {settings.store}",
        file=sys.stderr,
        flush=True,
    )
    print(f"  event loop: {loop_name(asyncio.get_running_loop())}", file=sys.stderr, flush=True)
    if not settings.admin_token:
        print("  control API off (no --admin-token)", file=sys.stderr, flush=True)
    elif listening.admin_url:
        print(f"  control API on {listening.admin_url}/admin", file=sys.stderr, flush=True)
    else:
        print(f"  control API on {state.listen_url}/admin", file=sys.stderr, flush=True)
    flusher = asyncio.create_task(_flush_logs_repeatedly(listening.gate))
    heap_trim = HeapTrim(settings.malloc_trim_interval)
    state.metrics.add_live(heap_trim.stats)
    trimmer = asyncio.create_task(heap_trim.run())
    await stop.wait()
    print("capture-proxy stopping: finishing in-flight calls", file=sys.stderr, flush=True)
    await listening.close()
    for task in (flusher, trimmer):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    listening.gate.flush_log(all_windows=True)
    flush_repeats(all_windows=True)
    return 1 if state.capture.ledger.unsaved or state.store_incomplete else 0
