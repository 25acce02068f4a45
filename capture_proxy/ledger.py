"""The write side of each rollout's ledger: every call that was not staged, and why.

Ledger entries go through the same sink as records. When the sink itself is failing, an entry
that cannot be written is held in memory (bounded), reported by `/readyz` and `/metrics`, and
written, in order, once the sink recovers: a rollout cut short must stay visible.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from .schemas.records import LedgerEntry
from .sinks.base import StagingSink

__all__ = ["Ledger"]

log = logging.getLogger("capture_proxy.ledger")


class Ledger:
    def __init__(self, sink: StagingSink, *, timeout: float, max_held: int = 100_000) -> None:
        self.sink = sink
        self.timeout = timeout
        #: Entries the sink refused to take (it is failing); retried by `flush`.
        self.held: deque[LedgerEntry] = deque(maxlen=max_held)

    async def write(self, entry: LedgerEntry) -> None:
        if self.held:
            self.held.append(entry)  # keep the ledger in order behind what is held
            await self.flush()
            return
        try:
            await asyncio.wait_for(self.sink.record_failure(entry), self.timeout)
        except Exception as e:
            log.error(
                "ledger entry for %s (%s) held in memory: the sink failed: %s",
                entry.call_id,
                entry.status,
                e,
                extra={"rollout_id": entry.rollout_id, "call_id": entry.call_id},
            )
            self.held.append(entry)

    async def flush(self) -> int:
        """Write held entries, oldest first; returns how many are still held."""
        while self.held:
            entry = self.held[0]
            try:
                await asyncio.wait_for(self.sink.record_failure(entry), self.timeout)
            except Exception:
                break
            self.held.popleft()
        return len(self.held)
