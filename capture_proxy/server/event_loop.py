"""The event loop `capture-proxy serve` runs on (``--loop``): uvloop where it is installed.

uvloop is asyncio's event loop rebuilt on libuv: the same API, with less CPU per socket read,
write, callback and timer, which is most of what the proxy does around each call
(docs/reports/performance.md measures it). ``--loop asyncio`` runs on the standard library's
loop instead; ``--loop uvloop`` on a machine where uvloop does not install (it has no Windows
build) runs on asyncio's loop too, and says so in the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LOOPS", "loop_factory", "loop_name", "run"]

log = logging.getLogger("capture_proxy")

T = TypeVar("T")

#: The values of ``--loop``; the first is the default.
LOOPS = ("uvloop", "asyncio")


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the event loop `name` (one of `LOOPS`); None: asyncio's own."""
    if name not in LOOPS:
        raise ValueError(f"unknown event loop {name!r} (one of {', '.join(LOOPS)})")
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as e:
        log.warning(
            "--loop uvloop: uvloop cannot be imported here (%s); running on asyncio's event loop",
            e,
        )
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which loop `loop` is (for the start-up banner and tests)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def run(main: Coroutine[Any, Any, T], loop: str = LOOPS[0]) -> T:
    """`asyncio.run` on the event loop named `loop`."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(main)
