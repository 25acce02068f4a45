"""Fixtures shared by every suite under tests/ (the helpers they use are in tests/support/)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from tests.support.proxy_harness import Proxy, ProxyFactory, start_proxy, stop_proxy
from tests.support.replicas import Fleet
from tests.support.s3 import MotoS3

# Hypothesis fails an example slower than 200 ms by default; on a shared 2-core machine under
# load a pure-CPU property can take that long. Speed is measured in bench/, never in a test.
settings.register_profile("capture-proxy", deadline=None)
settings.load_profile("capture-proxy")


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


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    """moto's S3 server on loopback for the whole session, its AWS variables set in this process
    (so pyarrow and obstore reach it); each test takes its own prefix with ``moto_s3.url()``."""
    with MotoS3(tmp_path_factory.mktemp("moto")) as server:
        old = server.apply_env()
        try:
            yield server
        finally:
            MotoS3.restore_env(old)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    """Replicas of the bundled fake vLLM on loopback ports, added by the test; closed after."""
    f = Fleet()
    yield f
    await f.close()
