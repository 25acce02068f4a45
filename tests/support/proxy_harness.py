"""A proxy in front of the bundled fake vLLM, both real aiohttp servers on loopback.

`start_proxy` is what the proxy tests build on: the fake upstream, the proxy app with its
settings, the sink (a real SQLite file unless a test passes another), and a reader on the same
store, so a test can send a call and then look at exactly what was staged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from capture_proxy.schemas.records import LedgerEntry, StagedCallRecord
from capture_proxy.server.app import create_app
from capture_proxy.server.settings import Settings
from capture_proxy.server.state import STATE, ProxyState
from capture_proxy.sinks.base import StagingSink, StagingSource
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.testing.fake_vllm import FakeVLLM


@dataclass
class Proxy:
    fake: FakeVLLM
    upstream: TestServer
    client: TestClient[web.Request, web.Application]
    sink: StagingSink
    store_url: str

    @property
    def state(self) -> ProxyState:
        return self.client.app[STATE]

    def source(self) -> StagingSource:
        if isinstance(self.sink, MemorySink):
            return self.sink
        return open_source(self.store_url)

    async def chat(
        self,
        body: Mapping[str, Any],
        *,
        rollout: str | None = "r1",
        headers: Mapping[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        path = f"/r/{rollout}/v1/chat/completions" if rollout else "/v1/chat/completions"
        sent = {"Content-Type": "application/json", **(headers or {})}
        return await self.client.post(path, data=orjson.dumps(body), headers=sent)

    def calls(self, rollout: str = "r1") -> list[StagedCallRecord]:
        src = self.source()
        try:
            return src.calls(rollout)
        finally:
            if not isinstance(self.sink, MemorySink):  # a reader of its own: close it
                src.close_reader()

    def failures(self, rollout: str = "r1") -> list[LedgerEntry]:
        src = self.source()
        try:
            return src.failures(rollout)
        finally:
            if not isinstance(self.sink, MemorySink):
                src.close_reader()


async def start_proxy(
    tmp_path: Path,
    *,
    fake: FakeVLLM | None = None,
    sink: StagingSink | None = None,
    **settings: Any,
) -> Proxy:
    """Start a fake vLLM and a proxy in front of it; stop both with `stop_proxy`."""
    fake = fake or FakeVLLM()
    upstream = TestServer(fake.app())
    await upstream.start_server()
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    if sink is None:
        sink = open_sink(store_url)
    values: dict[str, Any] = {
        "upstream": str(upstream.make_url("")).rstrip("/"),
        "store": store_url,
    }
    values.update(settings)
    names = {f.name for f in dataclasses.fields(Settings)}
    app = create_app(Settings(**{k: v for k, v in values.items() if k in names}), sink=sink)
    client: TestClient[web.Request, web.Application] = TestClient(
        TestServer(app, handler_cancellation=True)
    )
    await client.start_server()
    return Proxy(fake, upstream, client, sink, store_url)


async def stop_proxy(proxy: Proxy) -> None:
    await proxy.client.close()
    await proxy.upstream.close()


async def sse_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The response body's lines, as the client receives them."""
    async for line in resp.content:
        yield line.rstrip(b"\r\n")


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def chat_body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": list(messages), **extra}


class ProxyFactory(Protocol):
    """The `make_proxy` fixture (tests/conftest.py): `start_proxy` on demand, stopped after."""

    async def __call__(
        self, *, fake: FakeVLLM | None = None, sink: StagingSink | None = None, **settings: Any
    ) -> Proxy: ...
