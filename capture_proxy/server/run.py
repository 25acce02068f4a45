"""``capture-proxy serve``: run the application on its sockets until a signal stops it."""

from __future__ import annotations

import asyncio
import signal
import sys

from aiohttp import web

from .app import create_admin_app, create_app
from .settings import Settings
from .state import STATE

__all__ = ["serve"]


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
    app = create_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    # On SIGTERM the site stops listening, then waits up to shutdown_timeout for in-flight calls
    # and streams to finish before the cleanup context flushes the sink.
    site = web.TCPSite(
        runner, settings.host, settings.port, shutdown_timeout=settings.shutdown_timeout
    )
    await site.start()
    host, port = runner.addresses[0][:2]
    state = app[STATE]
    state.listen_url = f"http://{host}:{port}"
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
    admin_runner = None
    if not settings.admin_token:
        print("  control API off (no --admin-token)", file=sys.stderr, flush=True)
    elif settings.admin_port:
        admin_runner = web.AppRunner(create_admin_app(app), access_log=None)
        await admin_runner.setup()
        admin_host = settings.admin_host or settings.host
        await web.TCPSite(admin_runner, admin_host, settings.admin_port).start()
        print(
            f"  control API on http://{admin_host}:{settings.admin_port}/admin",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"  control API on {state.listen_url}/admin", file=sys.stderr, flush=True)
    await stop.wait()
    print("capture-proxy stopping: finishing in-flight calls", file=sys.stderr, flush=True)
    if admin_runner is not None:
        await admin_runner.cleanup()
    await runner.cleanup()
    return 1 if state.capture.ledger.unsaved else 0
