"""The baseline: a minimal aiohttp pass-through (no parsing, no capture), in its own process.

    .venv/bin/python bench/passthrough.py --upstream http://127.0.0.1:8000 [--port 0]

It reads the request body, POSTs it to the same path upstream over a pooled keep-alive session,
and returns the upstream's bytes: whole for a JSON answer, chunk by chunk as they arrive for an
event stream. This is the least an aiohttp proxy can do per call, so capture-proxy's CPU and added
latency are reported as multiples of it (docs/reports/performance.md). Prints ``listening on http://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import aiohttp
from aiohttp import web

from capture_proxy.server.event_loop import LOOPS, run

__all__ = ["make_app"]


def make_app(upstream: str) -> web.Application:
    base = upstream.rstrip("/")
    state: dict[str, aiohttp.ClientSession] = {}

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        state["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await state["s"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with state["s"].post(
            base + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as up:
            content_type = up.headers.get("Content-Type", "application/json")
            if not content_type.startswith("text/event-stream"):
                return web.Response(
                    status=up.status, body=await up.read(), headers={"Content-Type": content_type}
                )
            out = web.StreamResponse(status=up.status, headers={"Content-Type": content_type})
            await out.prepare(request)
            while chunk := await up.content.readany():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application(client_max_size=64 * 2**20)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/{tail:.*}", forward)
    return app


async def _serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(make_app(args.upstream), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port, backlog=1024).start()
    host, port = runner.addresses[0][:2]
    print(f"listening on http://{host}:{port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--loop", choices=LOOPS, default=LOOPS[0], help="event loop")
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        run(_serve(args), args.loop)


if __name__ == "__main__":
    main()
