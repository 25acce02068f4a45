"""Several fake vLLM replicas on loopback, and a proxy in front of all of them.

Each replica is the bundled fake vLLM as a real aiohttp server; `Fleet.stop` closes one (its
port then refuses connections, as a dead vLLM pod's does) and `Fleet.start` brings a replica up
on a port named in advance (a replica that starts after the proxy).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestServer

from capture_proxy.server.state import STATE
from capture_proxy.testing.fake_vllm import FakeVLLM
from capture_proxy.upstream.replicas import ReplicaSet

from .proxy_harness import Proxy, chat_body, start_proxy, user


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Fleet:
    """Fake vLLM replicas by URL (``http://127.0.0.1:PORT``, also their replica names)."""

    fakes: dict[str, FakeVLLM] = field(default_factory=dict)
    servers: dict[str, TestServer] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return list(self.fakes)

    def reserve(self, fake: FakeVLLM) -> str:
        """A URL for `fake`, served only once `start` is called."""
        url = f"http://127.0.0.1:{free_port()}"
        self.fakes[url] = fake
        return url

    async def start(self, url: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        server = TestServer(self.fakes[url].app(), host="127.0.0.1", port=port)
        await server.start_server()
        self.servers[url] = server

    async def add(self, fake: FakeVLLM | None = None) -> str:
        url = self.reserve(fake or FakeVLLM())
        await self.start(url)
        return url

    async def stop(self, url: str) -> None:
        await self.servers.pop(url).close()

    async def close(self) -> None:
        for url in list(self.servers):
            await self.stop(url)

    def served_by(self, url: str) -> int:
        """Chat calls `url`'s fake answered."""
        return len(self.fakes[url].requests)


class OtherTemplate(FakeVLLM):
    """A fake whose chat template differs (another model): another tokenizer fingerprint."""

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Any, gen: bool) -> str:
        return "<other model>" + super()._render(messages, tools, gen)


def replicas_of(p: Proxy) -> ReplicaSet:
    upstream = p.client.app[STATE].upstream
    assert isinstance(upstream, ReplicaSet)
    return upstream


async def until(check: Callable[[], bool], within: float = 10.0) -> None:
    """Wait until `check()` holds (probes run in the background)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def start_fleet_proxy(tmp_path: Path, fleet: Fleet, **settings: Any) -> Proxy:
    """A proxy in front of every replica of `fleet`, once its first probe round is done."""
    settings.setdefault("replica_probe_interval", 0.2)
    p = await start_proxy(tmp_path, upstream=",".join(fleet.urls), **settings)
    await replicas_of(p).probed.wait()
    return p


async def call(p: Proxy, rollout: str, text: str = "hello") -> Any:
    """One chat call of `rollout` through the fleet's proxy."""
    return await p.chat(chat_body(user(text)), rollout=rollout)
