"""Fixtures shared by every suite under tests/ (the helpers they use are in tests/support/)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.proxy_harness import Proxy, ProxyFactory, start_proxy, stop_proxy


@pytest.fixture
async def make_proxy(tmp_path: Path) -> AsyncIterator[ProxyFactory]:
    """Start proxies (each with its own fake vLLM and store) on demand; stop them after the test."""
    started: list[Proxy] = []

    async def make(**kwargs: Any) -> Proxy:
        p = await start_proxy(tmp_path / f"p{len(started)}", **kwargs)
        started.append(p)
        return p

    yield make
    for p in started:
        await stop_proxy(p)
