"""Staging writes with a deadline and a bound: `Stager`.

A sink slower than the stage timeout makes the call `capture_failed`; the write is not
cancelled (a half-cancelled write is worse than a late one), and the call is marked orphaned at
once, so if the write still lands no trainer uses it unknowingly. Writes in progress, late ones
included, never exceed `max_pending`: new calls are refused beyond it, and a stage waits for a
slot within its deadline, instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from ..schemas.records import Attachment, CallStatus, StagedCallRecord, StageResult
from ..sinks.base import StagingSink

__all__ = ["Stager"]

log = logging.getLogger("capture_proxy.staging")


class Stager:
    def __init__(self, sink: StagingSink, *, timeout: float, max_pending: int) -> None:
        self.sink = sink
        self.timeout = timeout
        self.max_pending = max_pending
        self.pending = 0
        # Writes in progress, late ones included, never exceed max_pending: a stage waits for a
        # slot (within its deadline) instead of piling more work onto a slow sink.
        self._slots = asyncio.Semaphore(max_pending)
        #: The last sink error while the sink keeps failing; cleared by the next staged write.
        self.sink_failing: str | None = None
        self._late: set[asyncio.Task[Any]] = set()

    @property
    def late_writes(self) -> int:
        """Writes (and orphan marks) still running past their deadline: the sink is slow."""
        return len(self._late)

    @property
    def full(self) -> bool:
        return self.pending >= self.max_pending

    async def stage(
        self, record: StagedCallRecord, attachments: Mapping[str, Attachment]
    ) -> StageResult:
        """Stage `record`; never raises: failures come back as ``capture_failed`` results."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        if self._slots.locked():
            try:
                await asyncio.wait_for(self._slots.acquire(), self.timeout)
            except TimeoutError:
                return StageResult.failed(
                    "staging_backlog",
                    f"{self.pending} staging writes stayed pending for {self.timeout:g}s "
                    f"(limit {self.max_pending})",
                )
        else:
            # A free slot is taken without suspending: no task and no timer for the common case.
            await self._slots.acquire()
        self.pending += 1
        task: asyncio.Task[StageResult] = asyncio.ensure_future(self._write(record, attachments))
        task.add_done_callback(self._done)
        try:
            # One timer for the deadline; `shield` keeps the write going if it passes.
            async with asyncio.timeout_at(deadline):
                result = await asyncio.shield(task)
        except TimeoutError:
            # The write goes on (a half-cancelled write is worse than a late one). Mark the call
            # orphaned now, queued behind the write: if the write lands, even during shutdown,
            # no trainer reads it as a normal record.
            self._late.add(task)
            task.add_done_callback(self._late.discard)
            orphan = asyncio.ensure_future(self._mark_orphaned(record.call_id))
            self._late.add(orphan)
            orphan.add_done_callback(self._late.discard)
            return StageResult.failed(
                "stage_timeout", f"the sink took longer than {self.timeout:g}s to stage"
            )
        except TypeError as e:
            # Most likely a sink that does not take attachments: its bytes are not staged.
            self.sink_failing = f"TypeError: {e}"
            return StageResult.failed("sink_rejected_attachments", f"TypeError: {e}")
        except Exception as e:  # the sink raised: a failed write leaves nothing behind
            log.warning(
                "stage %s failed: %s: %s",
                record.call_id,
                type(e).__name__,
                e,
                extra={"rollout_id": record.rollout_id, "call_id": record.call_id},
            )
            self.sink_failing = f"{type(e).__name__}: {e}"
            return StageResult.failed("sink_error", f"{type(e).__name__}: {e}")
        if result.status is CallStatus.STAGED:
            self.sink_failing = None
        return result

    async def _write(
        self, record: StagedCallRecord, attachments: Mapping[str, Attachment]
    ) -> StageResult:
        if attachments:
            # Passed only when there are attachments, so text-only sinks keep working; a sink
            # that does not take them fails with TypeError -> capture_failed, never a retry
            # with the attachments dropped.
            return await self.sink.stage(record, attachments=attachments)
        return await self.sink.stage(record)

    def _done(self, task: asyncio.Task[StageResult]) -> None:
        self.pending -= 1
        self._slots.release()
        if not task.cancelled():
            task.exception()  # retrieved, so a late failure is not logged as "never retrieved"

    async def _mark_orphaned(self, call_id: str) -> None:
        log.warning(
            "staging %s passed its deadline: marking it orphaned in case the write lands",
            call_id,
            extra={"call_id": call_id},
        )
        try:
            await self.sink.mark_orphaned(call_id, "stage_timeout")
        except Exception as e:  # the capture_failed ledger entry still says what happened
            log.error("could not mark %s orphaned: %s", call_id, e, extra={"call_id": call_id})

    async def drain(self, wait_s: float) -> None:
        """Wait for late writes and orphan marks (shutdown), up to `wait_s` seconds."""
        if self._late:
            await asyncio.wait(list(self._late), timeout=wait_s)
