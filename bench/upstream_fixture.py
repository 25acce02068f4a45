"""A fast vLLM-shaped upstream for the benchmark: answers from pre-built bytes, in its own process.

    .venv/bin/python bench/upstream_fixture.py [--port 0] [--delay 0.2] [--tick 0.001]

Every ``POST /v1/chat/completions`` gets a pre-built answer from `workload.build_workload`
(about 16k prompt ids, 1k completion tokens with logprobs): the one for the session turn that the
request's tag names (`workload.turn_of`), whatever else it asked for. The bytes are built once, so
this process spends almost no CPU per call and the proxy under test is what is measured.
``"stream":true`` in the body selects the streamed answer (byte searches, not a parse).

Timing, like a model server: `delay` is the service time before the first byte (the whole answer
for a non-streamed call, the first chunk of a stream). A stream then sends one event per token,
each in its own write, sleeping `tick` seconds after every `events_per_write` events, so the proxy
receives chunks as a generating server sends them instead of the whole stream in one read.

Also serves ``GET /version``, ``POST /tokenize`` (the proxy's tokenizer fingerprint) and
``GET /v1/models``. Prints ``listening on http://127.0.0.1:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import orjson
from aiohttp import web
from workload import Workload, build_workload, turn_of

from capture_proxy.server.event_loop import LOOPS, run

__all__ = ["make_app"]

_JSON = "application/json"


def _group(events: list[bytes], per_write: int) -> list[bytes]:
    """The writes a stream makes: the first and the last event alone, token events in groups."""
    first, *middle, done = events
    groups = [first]
    groups += [b"".join(middle[i : i + per_write]) for i in range(0, len(middle), per_write)]
    groups.append(done)
    return groups


def make_app(
    workload: Workload, *, delay: float, tick: float, events_per_write: int
) -> web.Application:
    answers = workload.answers
    streams = [_group(events, events_per_write) for events in workload.streams]
    version = orjson.dumps({"version": "0.32.0"})
    tokenize = orjson.dumps({"count": 8, "max_model_len": 40960, "tokens": list(range(1, 9))})
    models = orjson.dumps(
        {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "vllm"}]}
    )

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if delay > 0:
            await asyncio.sleep(delay)
        turn = turn_of(body)
        if b'"stream":true' not in body:
            return web.Response(body=answers[turn], content_type=_JSON)
        groups = streams[turn]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            for i, group in enumerate(groups):
                await resp.write(group)
                if tick > 0 and 0 < i < len(groups) - 2:
                    await asyncio.sleep(tick)
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp

    async def fixed(body: bytes) -> web.Response:
        return web.Response(body=body, content_type=_JSON)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/version", lambda r: fixed(version))
    app.router.add_post("/tokenize", lambda r: fixed(tokenize))
    app.router.add_get("/v1/models", lambda r: fixed(models))
    return app


async def _serve(args: argparse.Namespace) -> None:
    app = make_app(
        build_workload(args.seed),
        delay=args.delay,
        tick=args.tick,
        events_per_write=args.events_per_write,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=1024)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"listening on http://{host}:{port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0, help="service time before the first byte")
    p.add_argument("--tick", type=float, default=0.0, help="sleep between stream writes")
    p.add_argument("--events-per-write", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loop", choices=LOOPS, default=LOOPS[0], help="event loop")
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        run(_serve(args), args.loop)


if __name__ == "__main__":
    main()
