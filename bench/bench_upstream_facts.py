"""What the upstream facts cost per call: the engine weight read, and a new connection's check.

    .venv/bin/python bench/bench_upstream_facts.py --calls 300

Runs the proxy app in-process in front of the bundled fake vLLM (loopback, memory store) and
times sequential small unary calls, three ways: a plain fake (``/weight_info`` not served: asked
once, then never), a dev-mode fake (``GET /weight_info`` for each call before it is sent and
after its answer; concurrent calls share reads, sequential ones do not), and a
plain fake whose connections are closed after every answer (each call opens a new connection,
so the restart check asks for the facts again before sending it). Reported: median and p90
latency per call, and the fake's count of fact requests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from capture_proxy.server.app import create_app
from capture_proxy.server.settings import Settings
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.testing.fake_vllm import FakeVLLM

_BODY = orjson.dumps(
    {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
)


@web.middleware
async def _close_after(request: web.Request, handler: Any) -> web.StreamResponse:
    resp: web.StreamResponse = await handler(request)
    if request.path == "/v1/chat/completions":
        resp.force_close()
    return resp


async def _run(name: str, fake: FakeVLLM, calls: int, close: bool) -> None:
    app = fake.app()
    if close:
        app.middlewares.append(_close_after)
    up = web.AppRunner(app, access_log=None)
    await up.setup()
    site = web.TCPSite(up, "127.0.0.1", 0)
    await site.start()
    port = up.addresses[0][1]
    proxy = web.AppRunner(
        create_app(
            Settings(upstream=f"http://127.0.0.1:{port}", store="memory://bench"), sink=MemorySink()
        ),
        access_log=None,
    )
    await proxy.setup()
    await web.TCPSite(proxy, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{proxy.addresses[0][1]}/r/bench/v1/chat/completions"
    times: list[float] = []
    async with aiohttp.ClientSession() as http:
        for _ in range(calls):
            t0 = time.perf_counter()
            async with http.post(
                url, data=_BODY, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
                assert r.headers["X-Capture-Status"] == "staged"
            times.append(time.perf_counter() - t0)
    await proxy.cleanup()
    await up.cleanup()
    times.sort()
    p90 = times[int(len(times) * 0.9)]
    print(
        f"{name:<32} median {statistics.median(times) * 1e3:6.2f} ms  p90 {p90 * 1e3:6.2f} ms  "
        f"fact requests {dict(fake.route_hits)}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    await _run("plain (no /weight_info)", FakeVLLM(), args.calls, False)
    await _run("dev mode (/weight_info per call)", FakeVLLM(dev_mode=True), args.calls, False)
    await _run("new connection per call", FakeVLLM(), args.calls, True)


if __name__ == "__main__":
    asyncio.run(main())
