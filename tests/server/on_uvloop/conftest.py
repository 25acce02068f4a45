"""Every async test under this folder runs on uvloop (``--loop uvloop``, the proxy's default)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], object]]:
    return {"uvloop": uvloop.new_event_loop}
