"""Staging writes with a deadline and a bound: `Stager`.

A sink slower than the stage timeout makes the call `capture_failed`; the write is not cancelled
(a half-cancelled write is worse than a late one), and if it still lands, the record is marked
orphaned so no trainer uses it unknowingly. Writes in progress, late ones included, are counted:
the proxy refuses new calls beyond `max_pending` instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from .schemas.records import Attachment, CallStatus, StagedCallRecord, StageResult
from .sinks.base import StagingSink

__all__ = ["Stager"]

log = logging.getLogger("capture_proxy.staging")


class Stager:
    def __init__(self, sink: StagingSink, *, timeout: float, max_pending: int) -> None:
        self.sink = sink
        self.timeout = timeout
        self.max_pending = max_pending
        self.pending = 0
        #: The last sink error while the sink keeps failing; cleared by the next staged write.
        self.sink_failing: str | None = None
        self._late: set[asyncio.Task[Any]] = set()

    @property
    def full(self) -> bool:
        return self.pending >= self.max_pending

    async def stage(
        self, record: StagedCallRecord, attachments: Mapping[str, Attachment]
    ) -> StageResult:
        """Stage `record`; never raises: failures come back as ``capture_failed`` results."""
        self.pending += 1
        task: asyncio.Task[StageResult] = asyncio.ensure_future(self._write(record, attachments))
        task.add_done_callback(self._done)
        try:
            result = await asyncio.wait_for(asyncio.shield(task), self.timeout)
        except TimeoutError:
            self._late.add(task)
            task.add_done_callback(lambda t: self._landed_late(t, record.call_id))
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
        if not task.cancelled():
            task.exception()  # retrieved, so a late failure is not logged as "never retrieved"

    def _landed_late(self, task: asyncio.Task[StageResult], call_id: str) -> None:
        self._late.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        if task.result().status is CallStatus.STAGED:
            log.warning(
                "late write of %s landed after its stage timeout: marking it orphaned",
                call_id,
                extra={"call_id": call_id},
            )
            orphan = asyncio.ensure_future(self.sink.mark_orphaned(call_id, "stage_timeout"))
            self._late.add(orphan)
            orphan.add_done_callback(self._late.discard)

    async def drain(self, wait_s: float) -> None:
        """Wait for late writes and orphan marks (shutdown), up to `wait_s` seconds."""
        if self._late:
            await asyncio.wait(list(self._late), timeout=wait_s)
