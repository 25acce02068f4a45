"""`--loop`: which event loop `capture-proxy serve` runs on (`server/event_loop.py`).

The proxy serving on uvloop is tested in `tests/server/on_uvloop/`, and the real ``serve``
process on each loop in `tests/test_cli_serve.py`.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from capture_proxy.server.event_loop import LOOPS, loop_factory, loop_name, run
from capture_proxy.server.settings import Settings


async def _which_loop() -> str:
    return loop_name(asyncio.get_running_loop())


@pytest.mark.parametrize("name", LOOPS)
def test_run_uses_the_named_loop(name: str) -> None:
    assert run(_which_loop(), name) == name


def test_uvloop_is_the_default() -> None:
    assert Settings().loop == LOOPS[0] == "uvloop"


def test_without_uvloop_the_proxy_runs_on_asyncio_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now fails, as uninstalled
    with caplog.at_level(logging.WARNING, logger="capture_proxy"):
        assert loop_factory("uvloop") is None
        assert run(_which_loop(), "uvloop") == "asyncio"
    assert "uvloop cannot be imported here" in caplog.text
    assert "running on asyncio's event loop" in caplog.text


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown event loop 'trio'"):
        loop_factory("trio")
