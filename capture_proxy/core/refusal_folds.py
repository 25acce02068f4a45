"""A rollout's refused calls past a rate, written to its ledger together.

``--max-rollout-refusal-rows``.

Every call the proxy refuses before admission (a 4xx: over a limit, a body it cannot take) is a
ledger entry of its rollout, with a call id and a sequence number, so a trainer sees what
happened to every call. A sandbox that floods its rollout with calls the proxy refuses (1,000
streams at once over ``--max-inflight-per-rollout``, issue 27) made each refusal a call id from
the operating system's random source, a sequence number, a task on the event loop and a row in
the store: the loop and the store's writer were busy with the flood while every other sandbox's
calls waited.

So each rollout's refusals are written one by one up to `rate` a second (a token bucket with
twice that saved up); past it a refusal joins the rollout's *fold*: one ledger entry, reason
``refusals_folded``, with its own call id and sequence number, written `WINDOW` seconds after its
first refusal and counting every refusal it stands for. Each folded call's client gets the 4xx
it would have got, with the fold's call id (``X-Capture-Call-Id``), so the id it was given is in
the ledger and says what became of it. The fold's message says how many calls it stands for,
when, and why (`FOLD_FORMAT`; `folded_refusals` reads the count back), and ``/metrics`` counts
every refusal as before, one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..schemas.records import CallStatus, LedgerEntry
from .ids import new_call_id
from .rollouts import CallOutcome, RolloutLive

__all__ = ["FOLD_REASON", "WINDOW", "RefusalFolds", "folded_refusals"]

#: The reason of a ledger entry that stands for several refused calls.
FOLD_REASON = "refusals_folded"
#: Seconds from a fold's first refusal to its entry's write.
WINDOW = 1.0
#: Rollouts whose buckets are remembered; the least recently refused are forgotten past it.
_REMEMBERED = 100_000
#: The start of a fold's message: ``<n> calls refused``; `folded_refusals` reads it back.
_COUNT = re.compile(r"(\d+) calls refused ")


def folded_refusals(entry: LedgerEntry) -> int:
    """How many refused calls a ledger entry stands for: its count for a fold
    (``reason == "refusals_folded"``), else 1."""
    if entry.reason != FOLD_REASON:
        return 1
    found = _COUNT.match(entry.message)
    return int(found.group(1)) if found else 1


@dataclass(eq=False)
class _Fold:
    live: RolloutLive
    call_id: str
    seq: int
    first_ms: int
    last_ms: int = 0
    count: int = 0
    why: Counter[tuple[str, int]] = field(default_factory=Counter)
    last_message: str = ""
    due: asyncio.Event = field(default_factory=asyncio.Event)

    def entry(self, rate: float) -> LedgerEntry:
        reasons = ", ".join(f"{why} x{n} (HTTP {http})" for (why, http), n in self.why.items())
        (_, http), _ = self.why.most_common(1)[0]
        message = (
            f"{self.count} calls refused from {self.first_ms} to {self.last_ms} (ms since the "
            f"epoch), written as this one entry (--max-rollout-refusal-rows {rate:g}): "
            f"{reasons}; the last: {self.last_message}"
        )
        return LedgerEntry(
            self.live.rollout_id,
            self.call_id,
            self.seq,
            CallStatus.REJECTED,
            FOLD_REASON,
            message,
            http,
            self.first_ms,
        )


class RefusalFolds:
    """Per rollout, refusals written one by one up to `rate` a second; past it, folded.

    `rate` 0 writes every refusal on its own. `write` writes a ledger entry (the ledger
    writer's)."""

    def __init__(self, rate: float, write: Callable[[LedgerEntry], Awaitable[None]]) -> None:
        self.rate = rate
        self.burst = max(1.0, 2 * rate)
        self._write = write
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._open: dict[str, _Fold] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Refusals written as part of a fold rather than on their own.
        self.folded = 0

    def take(self, rollout_id: str) -> bool:
        """Whether the rollout's next refusal is written on its own (a row of its bucket)."""
        if self.rate <= 0:
            return True
        if rollout_id in self._open:
            return False  # its fold is open: refusals join it until it is written
        now = time.monotonic()
        level, at = self._buckets.pop(rollout_id, (self.burst, now))
        level = min(self.burst, level + (now - at) * self.rate)
        taken = level >= 1.0
        self._buckets[rollout_id] = (level - 1.0 if taken else level, now)
        if len(self._buckets) > _REMEMBERED:
            self._buckets.popitem(last=False)
        return taken

    def join(self, live: RolloutLive, reason: str, message: str, http_status: int) -> str:
        """Count a refusal in the rollout's open fold (opening one); returns the fold's call id."""
        fold = self._open.get(live.rollout_id)
        now_ms = int(time.time() * 1000)
        if fold is None:
            fold = _Fold(live, new_call_id(), live.take_seq(), now_ms)
            self._open[live.rollout_id] = fold
            live.outcomes[fold.call_id] = CallOutcome(
                fold.seq, fold.call_id, CallStatus.REJECTED, reason=FOLD_REASON, message=""
            )
            # In flight until written, as a refusal is: the rollout stays in memory (its seq
            # handed out) and a seal waits for the entry.
            live.enter()
            task = asyncio.ensure_future(self._close(fold))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        fold.count += 1
        fold.last_ms = now_ms
        fold.why[(reason, http_status)] += 1
        fold.last_message = message
        self.folded += 1
        return fold.call_id

    async def _close(self, fold: _Fold) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fold.due.wait(), WINDOW)
        del self._open[fold.live.rollout_id]
        entry = fold.entry(self.rate)
        fold.live.outcomes[fold.call_id] = CallOutcome(
            fold.seq,
            fold.call_id,
            CallStatus.REJECTED,
            reason=FOLD_REASON,
            http_status=entry.http_status,
            message=entry.message,
        )
        try:
            await self._write(entry)
        finally:
            fold.live.leave()

    async def flush(self) -> None:
        """Write every open fold now (shutdown): the ledger then holds or spills them."""
        for fold in list(self._open.values()):
            fold.due.set()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
