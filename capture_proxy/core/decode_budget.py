"""The bytes of request bodies decoded at once, bounded (``--max-decoding-bytes``).

Decoding is where a body costs the most: a body's JSON becomes Python objects worth up to its own
size + 32 MiB (`capture_proxy.schemas.request.DEFAULT_MAX_JSON_ITEMS`), and the decode, the
validation and the base64 of its images run on worker threads that share one interpreter lock
with the event loop. Any number of bodies may be *arriving* at once (each bounded by the body
limit and the body deadline, and a trickled body holds only what has arrived), but only this many
bytes of them are decoded at once: a sandbox that sends many large bodies waits its turn, in
arrival order, instead of multiplying the proxy's memory.

A body larger than the whole budget is decoded alone. A call that cannot start within
`DecodeBudget.wait_s` gets 503 ``decode_budget_full`` with Retry-After, recorded as any refused
call is.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from ..errors import CaptureUnavailable

__all__ = ["DecodeBudget"]


class DecodeBudget:
    """A first-come, first-served byte budget for bodies being decoded (0: unbounded).

    Attributes:
        limit: bytes of bodies decoded at once; 0 leaves decoding unbounded (the library's
            default: an in-process caller decodes its own bodies).
        wait_s: seconds a body may wait for its turn before the call is refused.
        used: bytes held now (for `/metrics` and the tests).
    """

    def __init__(self, limit: int, wait_s: float = 10.0) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self.used = 0
        self._queue: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        """Hold `size` bytes of the budget while the body is decoded.

        Raises `CaptureUnavailable` (503, Retry-After) if its turn does not come in `wait_s`.
        """
        if self.limit <= 0:
            yield
            return
        size = min(size, self.limit)  # a body over the whole budget is decoded alone
        if self._queue or self.used + size > self.limit:
            await self._wait(size)
        else:
            self.used += size
        try:
            yield
        finally:
            self.used -= size
            self._wake()

    async def _wait(self, size: int) -> None:
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (size, turn)
        self._queue.append(entry)
        try:
            async with asyncio.timeout(self.wait_s):
                await turn
        except TimeoutError:
            self._give_up(entry)
            raise self._full() from None
        except BaseException:  # the client went away, or the proxy is stopping
            self._give_up(entry)
            raise

    def _give_up(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        size, turn = entry
        if turn.done() and not turn.cancelled():
            self.used -= size  # granted just as the wait ended: the bytes go to the next one
        else:
            with contextlib.suppress(ValueError):
                self._queue.remove(entry)
        self._wake()

    def _wake(self) -> None:
        # In order: the head waits for room even if a smaller body behind it would fit, so a
        # large honest body is never starved by a stream of small ones.
        while self._queue and self.used + self._queue[0][0] <= self.limit:
            size, turn = self._queue.popleft()
            if turn.done():
                continue
            self.used += size
            turn.set_result(None)

    def _full(self) -> CaptureUnavailable:
        return CaptureUnavailable(
            f"the proxy is decoding {self.used} bytes of request bodies, its limit "
            f"(--max-decoding-bytes {self.limit}); no turn came within {self.wait_s:g} s",
            code="decode_budget_full",
            headers={"Retry-After": "1"},
        )
