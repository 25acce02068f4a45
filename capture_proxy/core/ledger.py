"""The write side of each rollout's ledger: every call that was not staged, and why.

Ledger entries go through the same sink as records. When the sink itself is failing, an entry
that cannot be written is held in memory (bounded), reported by `/readyz` and `/metrics`, and
written, in order, once the sink recovers: a rollout cut short must stay visible. Entries still
held when the proxy stops are spilled to the ledger journal (`core/journal.py`), to be replayed
into the store at the next start.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from ..schemas.records import LedgerEntry
from ..sinks.base import DuplicateSeq, StagingSink
from .handback import MAX_RESEQ
from .journal import spill_journal

__all__ = ["LedgerWriter"]

log = logging.getLogger("capture_proxy.ledger")


class LedgerWriter:
    """Writes ledger entries through the sink; holds, in order, what a failing sink refused."""

    def __init__(self, sink: StagingSink, *, timeout: float, max_held: int = 100_000) -> None:
        self.sink = sink
        self.timeout = timeout
        #: Entries the sink refused to take (it is failing); retried by `flush`.
        self.held: deque[LedgerEntry] = deque(maxlen=max_held)
        self._late: set[asyncio.Task[None]] = set()
        #: An entry the store refused at its seq (`DuplicateSeq`: another call holds it) at
        #: another, free seq (`Capture`: the rollout read again from the store), or None; it
        #: is written there. Without one, or when it gives None, the entry is refused.
        self.reseq: Callable[[LedgerEntry], Awaitable[LedgerEntry | None]] | None = None
        #: Entries the store refused for good (`DuplicateSeq`, and no free seq for them):
        #: logged, never written.
        self.refused = 0
        #: Entries written at another seq than their call's (`reseq`).
        self.moved = 0
        #: Held entries pushed out by newer ones (more than `max_held` held): logged, lost.
        self.dropped = 0
        #: Entries written to the journal (or stderr) at shutdown, and where (`spill`).
        self.spilled = 0
        self.spilled_to = ""
        # One flush at a time: an entry stays first in `held` until the sink has taken it, so
        # two flushes at once would both send it.
        self._flushing = asyncio.Lock()

    async def write(self, entry: LedgerEntry) -> None:
        if self.held:
            self._hold(entry)  # keep the ledger in order behind what is held
            await self.flush()
            return
        if not await self._send(entry):
            self._hold(entry)

    def _hold(self, entry: LedgerEntry) -> None:
        if len(self.held) == self.held.maxlen:
            lost = self.held[0]
            self.dropped += 1
            log.error(
                "more than %d ledger entries held: the oldest is lost: %s seq %d %s %s: %s",
                self.held.maxlen,
                lost.call_id,
                lost.seq,
                lost.status,
                lost.reason,
                lost.message,
                extra={"rollout_id": lost.rollout_id, "call_id": lost.call_id},
            )
        self.held.append(entry)

    async def _send(self, entry: LedgerEntry, depth: int = 0) -> bool:
        """True once the sink took `entry` or is still taking it past the deadline.

        A write that outlives the deadline is not sent again (that would write the entry twice):
        it is held for a retry only if it finally fails.
        """
        task = asyncio.ensure_future(self.sink.record_failure(entry))
        try:
            await asyncio.wait_for(asyncio.shield(task), self.timeout)
        except TimeoutError:
            self._late.add(task)
            task.add_done_callback(lambda t: self._late_done(t, entry))
            return True
        except asyncio.CancelledError:
            # The caller was cancelled (shutdown), not the write: it goes on, counted and waited
            # for (`drain`) like a late one, and held again if it fails.
            self._late.add(task)
            task.add_done_callback(lambda t: self._late_done(t, entry))
            raise
        except DuplicateSeq as e:
            # The store will never take it at this seq (another call holds it): holding it would
            # stall every later entry behind it. Written at a free seq instead, else logged.
            try:
                moved = await self._reseq(entry, e, depth)
            except Exception as read_error:
                self._unplaced(entry, read_error)
                return False  # held: the next flush tries again
            if moved is not None and not await self._send(moved, depth + 1):
                self._hold(moved)
            return True
        except Exception as e:
            log.error(
                "ledger entry for %s (%s) held in memory: the sink failed: %s",
                entry.call_id,
                entry.status,
                e,
                extra={"rollout_id": entry.rollout_id, "call_id": entry.call_id},
            )
            return False
        return True

    def _late_done(self, task: asyncio.Task[None], entry: LedgerEntry) -> None:
        self._late.discard(task)
        error = None if task.cancelled() else task.exception()
        if isinstance(error, DuplicateSeq):
            moving = asyncio.ensure_future(self._late_reseq(entry, error))
            self._late.add(moving)
            moving.add_done_callback(self._late.discard)
        elif task.cancelled() or error is not None:
            self._hold(entry)

    async def _late_reseq(self, entry: LedgerEntry, error: DuplicateSeq) -> None:
        try:
            moved = await self._reseq(entry, error, 0)
        except Exception as read_error:
            self._unplaced(entry, read_error)
            self._hold(entry)
            return
        if moved is not None and not await self._send(moved, 1):
            self._hold(moved)

    def _unplaced(self, entry: LedgerEntry, error: Exception) -> None:
        log.error(
            "ledger entry for %s (%s) held in memory: its seq %d is another call's, and the "
            "store could not be read for a free one: %s: %s",
            entry.call_id,
            entry.status,
            entry.seq,
            type(error).__name__,
            error,
            extra={"rollout_id": entry.rollout_id, "call_id": entry.call_id},
        )

    async def _reseq(
        self, entry: LedgerEntry, error: DuplicateSeq, depth: int
    ) -> LedgerEntry | None:
        """`entry` at a free seq, or None (then refused: logged, counted). Raises what reading
        the store for a free seq raised: the entry is then held, and tried again."""
        moved = None
        if self.reseq is not None and depth < MAX_RESEQ:
            moved = await self.reseq(entry)
        if moved is None:
            self._refused(entry, error)
        else:
            self.moved += 1
        return moved

    def _refused(self, entry: LedgerEntry, error: DuplicateSeq) -> None:
        self.refused += 1
        log.error(
            "ledger entry refused by the store, not written: %s; the entry: %s seq %d %s %s: %s",
            error,
            entry.call_id,
            entry.seq,
            entry.status,
            entry.reason,
            entry.message,
            extra={"rollout_id": entry.rollout_id, "call_id": entry.call_id},
        )

    async def flush(self) -> int:
        """Write held entries, oldest first; returns how many are still held.

        An entry leaves `held` only once the sink has taken it (or took it past the deadline:
        then it is counted in `late`), so while it is being written it still counts as held and
        ``/readyz`` does not report the ledger written before it is in the store.
        """
        async with self._flushing:
            while self.held:
                entry = self.held[0]
                try:
                    sent = await self._send(entry)
                except asyncio.CancelledError:
                    self._taken(entry)  # its write goes on as a late one
                    raise
                if not sent:
                    break
                self._taken(entry)
        return len(self.held)

    def _taken(self, entry: LedgerEntry) -> None:
        # Unless newer entries pushed it out meanwhile (more than `max_held` held).
        if self.held and self.held[0] is entry:
            self.held.popleft()

    def spill(self, journal: str | None) -> int:
        """Move every held entry to the ledger journal at `journal` (stderr where it is None or
        cannot be written); returns how many. Blocking: shutdown only, once the sink is closed.
        """
        entries = list(self.held)
        if entries:
            self.spilled_to = spill_journal(entries, journal)
            self.spilled += len(entries)
            self.held.clear()
        return len(entries)

    @property
    def unsaved(self) -> int:
        """Entries that never reached the store in this run: spilled or dropped."""
        return self.spilled + self.dropped

    @property
    def late(self) -> int:
        """Ledger writes still running past their deadline."""
        return len(self._late)

    async def drain(self, wait_s: float) -> None:
        """Wait for ledger writes that outlived their deadline (shutdown)."""
        if self._late:
            await asyncio.wait(list(self._late), timeout=wait_s)
