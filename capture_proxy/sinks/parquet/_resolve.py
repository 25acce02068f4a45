"""Reading a rollout a writer does not hold from the store, before its work is queued.

A writer touching a rollout it does not hold (new to it, handed over by another writer, or
dropped after another writer's claim refused one of its seqs: a hand-back) reads the rollout's
highest claim and, when the store has the rollout, its event chain (the head to continue, its
staged calls); a call whose parent another writer staged needs the parent's tokens too. Read on
the writer thread, every call queued behind it waited for those reads, and for the writer's
reader, whose lock resumes and the follower hold for seconds on a busy store: with the reader
busy for 4 s at a hand-off, four other rollouts' calls and the moved call failed at a 2 s
``--stage-timeout``, poisoning their rollouts (docs/reports/handoffs.md).

So the reads are made before the work is queued, off the writer thread, on threads of the
writer's own (`ReadAhead.read`: the writes of one rollout queued before the first of them runs
share one read), or ahead of the call by the proxy when it resumes the rollout
(`ParquetSink.prepare_rollout`, within ``--rollout-resume-timeout``); the writer thread only
applies what was read (`ParquetSink._resolve`). A read is applied only if it is still true for
this writer: none of its own writes to the rollout can have happened since, which `ReadAhead`
checks by when the rollout last left the writer's memory; otherwise (rare: a write queued while
the rollout was held, run after it left) the writer thread reads the rollout itself, counted as
``writer_thread_resolves_total``. A parent's tokens are read within `PARENT_READ_S`; past it
the record is stored whole (exact, larger), never read on the writer thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ...schemas.records import StagedCallRecord
from ._claims import last_claim
from ._events import EventHeads
from ._fs import DatasetFS
from ._index import LRU
from ._keys import RolloutIds, RolloutKeys
from ._source import ParquetSource
from ._writer import UnitRows, Work

__all__ = ["ReadAhead", "Resolution", "handoff_from", "keys_from", "read_rollout"]

log = logging.getLogger(__name__)

#: A call's id and its rollout's id with its full sequence (the writer's cache of them).
Fulls = LRU[str, "tuple[str, array[int]]"]

#: A rollout read ahead (`ParquetSink.prepare_rollout`) is used by the rollout's next write only
#: within this many seconds; an older one is read again (another writer may have continued it).
PREPARED_MAX_AGE_S = 10.0
#: How long a record's write waits for its parent's sequence to be read from the store when the
#: writer has not got it (another writer staged the parent, or it left the writer's cache); past
#: this, or if the read fails, the record is stored whole (exact, only larger).
PARENT_READ_S = 2.0
#: Threads a writer reads ahead with (their reads of the writer's reader take turns: more would
#: only wait; the claim listings do not).
_THREADS = 2
#: Rollouts read ahead and not written yet, kept at most (the oldest go first).
_PREPARED_KEPT = 1024


@dataclass(frozen=True, slots=True)
class Resolution:
    """A rollout as the store had it when `stamp` was the writer's leave count."""

    rollout_id: str
    stamp: int
    #: `time.monotonic` when the reads ended.
    at: float
    #: The highest claim: (seq, call id, writer), None when the rollout has none.
    last: tuple[int, str, str] | None
    #: Whether its events were read: not for a new rollout (no claim, and the writer did not
    #: know it as stored).
    events_read: bool
    #: The last event's (position, hash), where the writer continues the chain.
    head: tuple[int, str] | None
    #: The calls staged in it (a duplicate staging key is refused).
    staged: frozenset[str]


def read_rollout(
    dfs: DatasetFS, reader: ParquetSource, rollout_id: str, *, known: bool, stamp: int
) -> Resolution:
    """One listing of the rollout's claims and, unless it is new (no claim, not `known` as
    stored), its events through `reader`: a writer's store reads for a rollout it does not
    hold, made on any thread but the writer's."""
    last = last_claim(dfs, rollout_id)
    if last is None and not known:
        return Resolution(rollout_id, stamp, time.monotonic(), None, False, None, frozenset())
    head, staged = stored_chain(reader, rollout_id)
    at = time.monotonic()
    return Resolution(rollout_id, stamp, at, last, True, head, staged)


def stored_chain(
    reader: ParquetSource, rollout_id: str
) -> tuple[tuple[int, str] | None, frozenset[str]]:
    """One read of a rollout's committed events: its chain's head (position, hash; None: no
    event stored) and the calls staged in it."""
    events = reader.events(rollout_id)
    head = (events[-1].position, events[-1].hash) if events else None
    return head, frozenset(e.call_id for e in events if e.call_id and e.kind == "staged")


class ReadAhead:
    """A writer's reads of rollouts it does not hold, made before their work is queued.

    Knows when each rollout last left the writer's memory (a leave count: `left`, `fresh`, on
    the writer thread) and keeps the rollouts read ahead of their next write (`prepare`); `read`
    and `prepare` run on the event loop, their reads in worker threads. `holds` says whether the
    writer holds a rollout (its memory, read from the loop: a hint, checked again on the writer
    thread); `rollouts` the rollouts it knows are stored."""

    def __init__(
        self,
        dfs: DatasetFS,
        reader: ParquetSource,
        holds: Callable[[str], bool],
        rollouts: RolloutIds,
        fulls: Fulls,
        kept: int,
    ) -> None:
        self._fulls = fulls
        # Threads of its own: reads waiting for a busy reader must not take the event loop's
        # default workers (6 on 2 cores), which resumes and other blocking work share.
        self._pool = ThreadPoolExecutor(_THREADS, "parquet-read-ahead")
        self._dfs = dfs
        self._reader = reader
        self._holds = holds
        self._rollouts = rollouts
        #: Rollouts that left the writer's memory so far; a read records it when it starts.
        self.stamp = 0
        self._left: OrderedDict[str, int] = OrderedDict()
        self._kept = max(1, kept)
        #: The latest leave no longer in `_left`: a read started before it is not trusted.
        self._floor = -1
        self._prepared: OrderedDict[str, Resolution] = OrderedDict()
        self._reading: dict[str, asyncio.Future[Resolution]] = {}
        #: The read of the job running on the writer thread (`offer`).
        self.offered: Resolution | None = None
        #: Rollouts the writer thread had to read itself (a read ahead was stale or missing).
        self.in_writer = 0

    async def prepare(self, rollout_id: str) -> None:
        """Read `rollout_id` now for its next writes (`ParquetSink.prepare_rollout`)."""
        if not self._dfs.local and not self._holds(rollout_id):
            await self._shared(rollout_id)

    async def read(self, rollout_id: str) -> Resolution | None:
        """`rollout_id` as the store has it, unless the writer holds it (or the dataset is a
        local folder: one writer, nothing to read): read ahead lately, or read now. The writes
        of a rollout queued before the first of them runs share one read."""
        if self._dfs.local or self._holds(rollout_id):
            return None
        read = self._prepared.get(rollout_id)
        if (
            read is not None
            and time.monotonic() - read.at <= PREPARED_MAX_AGE_S
            and self._fresh(rollout_id, read)
        ):
            return read
        return await self._shared(rollout_id)

    async def _shared(self, rollout_id: str) -> Resolution:
        """The rollout's read in progress, or a new one; kept for its next writes once done
        (shielded: a caller that gives up, a resume past its bound, leaves it for the retry)."""
        reading = self._reading.get(rollout_id)
        if reading is None:
            loop = asyncio.get_running_loop()
            reading = loop.run_in_executor(self._pool, self._read, rollout_id)
            self._reading[rollout_id] = reading
            reading.add_done_callback(functools.partial(self._done, rollout_id))
        return await asyncio.shield(reading)

    def _done(self, rollout_id: str, reading: asyncio.Future[Resolution]) -> None:
        self._reading.pop(rollout_id, None)
        if reading.cancelled() or reading.exception() is not None:
            return  # its callers have the error; the next write reads again
        self._prepared[rollout_id] = reading.result()
        self._prepared.move_to_end(rollout_id)
        while len(self._prepared) > _PREPARED_KEPT:
            self._prepared.popitem(last=False)

    async def parent(self, record: StagedCallRecord) -> tuple[str, array[int]] | None:
        """The record's parent's full sequence when the writer has not got it (another writer
        staged the parent: a hand-off), read from the store within `PARENT_READ_S`; None
        otherwise (no parent, cached, a local folder, or not read in time: the writer thread
        then stores the record whole, never reading the store for it)."""
        parent = record.parent_call_id
        if self._dfs.local or parent is None or parent in self._fulls:
            return None
        loop = asyncio.get_running_loop()
        full = loop.run_in_executor(self._pool, self._reader.full, parent, record.rollout_id)
        try:
            return parent, await asyncio.wait_for(full, PARENT_READ_S)
        except (TimeoutError, KeyError, ValueError, OSError) as e:
            log.info("%s: stored whole, its parent not read: %r", record.call_id, e)
            return None

    def _read(self, rollout_id: str) -> Resolution:
        stamp = self.stamp  # before the reads: a leave during them makes the read stale
        known = rollout_id in self._rollouts
        return read_rollout(self._dfs, self._reader, rollout_id, known=known, stamp=stamp)

    def offer(self, read: Resolution | None, work: Work) -> Work:
        """`work`, with `read` in `offered` while it runs on the writer thread."""
        if read is None:
            return work

        def run(batch: UnitRows, part: UnitRows) -> object:
            self.offered = read
            try:
                return work(batch, part)
            finally:
                self.offered = None

        return run

    def close(self) -> None:
        """Stop its threads once the reads running end (`ParquetSink.close`)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fresh(self, rollout_id: str, read: Resolution) -> bool:
        # Read from the event loop too: a leave the writer records meanwhile is checked again
        # on the writer thread, before the read is applied.
        return read.stamp > max(self._left.get(rollout_id, -1), self._floor)

    def left(self, rollout_id: str) -> None:
        """`rollout_id` left the writer's memory: what was read of it before is stale."""
        self._left[rollout_id] = self.stamp
        self._left.move_to_end(rollout_id)
        self.stamp += 1
        while len(self._left) > self._kept:
            _, stamp = self._left.popitem(last=False)
            self._floor = max(self._floor, stamp)

    def keys(
        self, rollout_id: str, writer_id: str, created_now: set[int], events: EventHeads
    ) -> RolloutKeys | None:
        """What the running job's read says of `rollout_id`, applied (`keys_from`); None when
        there is none, or it is stale: the rollout left the writer's memory since the read
        started, so something this writer wrote of it may be missing from the read. The
        writer thread then reads the rollout itself (counted in `in_writer`)."""
        read = self.offered
        found = None
        if read is not None and read.rollout_id == rollout_id and self._fresh(rollout_id, read):
            found = keys_from(read, writer_id, created_now, events=events, rollouts=self._rollouts)
        if found is None:
            self.in_writer += 1
        return found


def handoff_from(last: tuple[int, str, str] | None, writer_id: str) -> dict[str, Any] | None:
    """The ``handoff`` event's body when another writer claimed the rollout's last seq."""
    if last is None or not last[2] or last[2] == writer_id:
        return None
    seq, call_id, writer = last
    return {
        "from_writer": writer,
        "to_writer": writer_id,
        "after_seq": seq,
        "after_call_id": call_id,
    }


def keys_from(
    read: Resolution,
    writer_id: str,
    created_now: set[int],
    *,
    events: EventHeads,
    rollouts: RolloutIds,
) -> RolloutKeys | None:
    """What `read` says the writer holds of its rollout, applied on the writer thread (its
    rollout ids and chain heads updated); None when the read cannot say (the writer read its
    own claim of this batch as the last, or the rollout was stored since it was read as new):
    the writer thread then reads the rollout itself."""
    rollout_id, last = read.rollout_id, read.last
    if last is not None and last[2] == writer_id and last[0] in created_now:
        return None  # this batch's own claim hides whose claim came before it
    if not read.events_read:
        return None if rollout_id in rollouts else RolloutKeys()
    rollouts.add(rollout_id)
    events.reset(rollout_id, read.head)
    return RolloutKeys(set(read.staged), handoff_from(last, writer_id))
