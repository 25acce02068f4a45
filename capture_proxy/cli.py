"""The `capture-proxy` command: serve, and the store tools built on the reader."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from .logs import setup_logging
from .policy import PolicyError
from .settings import SettingsError, add_arguments, load_settings, settings_markdown

log = logging.getLogger("capture_proxy")

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="capture-proxy",
        description="OpenAI-compatible proxy in front of vLLM that stages the exact tokens of "
        "every call, or reports loudly that it could not.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the proxy",
        description="Run the proxy. Every option can also be set with a CAPTURE_PROXY_* "
        "environment variable (flag > environment > default).",
    )
    add_arguments(serve)
    settings = sub.add_parser("settings", help="list every setting (flag, environment, TOML key)")
    settings.add_argument("--markdown", action="store_true", help="as the docs/settings.md page")
    return p


async def _serve(settings_args: argparse.Namespace) -> int:
    from aiohttp import web

    from .app import create_admin_app, create_app
    from .state import STATE

    settings = load_settings(settings_args)
    setup_logging(settings.log_level, settings.log_format)
    log.info("starting with settings %s", settings.public())
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
    print(
        f"capture-proxy listening on {state.listen_url} -> upstream {state.upstream_url}, "
        f"store {settings.store}",
        flush=True,
    )
    print(
        f"  point OpenAI clients at {state.listen_url}/r/<rollout-id>/v1 ; "
        f"inspect with: capture-proxy inspect {settings.store}",
        flush=True,
    )
    admin_runner = None
    if not settings.admin_token:
        print("  control API off (no --admin-token)", flush=True)
    elif settings.admin_port:
        admin_runner = web.AppRunner(create_admin_app(app), access_log=None)
        await admin_runner.setup()
        await web.TCPSite(admin_runner, settings.host, settings.admin_port).start()
        print(f"  control API on http://{settings.host}:{settings.admin_port}/admin", flush=True)
    else:
        print(f"  control API on {state.listen_url}/admin", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("capture-proxy stopping: finishing in-flight calls", flush=True)
    if admin_runner is not None:
        await admin_runner.cleanup()
    await runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return asyncio.run(_serve(args))
        if args.command == "settings":
            sys.stdout.write(settings_markdown())
            return 0
    except (SettingsError, PolicyError) as e:
        print(f"capture-proxy: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"capture-proxy: {e}", file=sys.stderr)
        return 1
    return 2
