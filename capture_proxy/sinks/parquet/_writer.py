"""`UnitWriter`: one thread turns queued writes into committed units of a Parquet dataset.

Callers on an event loop `submit` a piece of work; the writer thread takes everything queued (up
to `max_batch`), first lets `settle` see the whole batch (the sink writes the batch's seq claims
there, all at once), then runs each piece against a fresh `UnitRows` of its own, merging it into the
batch only when the piece returns: a piece that raises (a fault hook, an encoding error) leaves
no row behind and its caller gets the exception, while the rest of the batch commits. The batch
is then written as one unit (`_layout`): data files under temporary names, fsynced,
renamed; then the commit marker, the same way. Only after the marker is durable is any caller
answered. If writing fails, the unit is retracted (marker first, then its files), every caller
of the batch gets a `StoreError`, and nothing of the batch is visible.

Work whose ``defer`` attribute is true (an admission claim: `_keys.Claimed`) is durable without a
unit of its own: its caller is answered once the batch has run it, and its rows wait for the next
unit written, whatever the batch that writes it (a call's claim event then commits with the
call's record or ledger entry, in one unit instead of two). A batch of deferred work alone writes
no unit. The rows waiting go first in the next unit, in the order they were made; if that unit
fails they are dropped with it, and `close` writes what still waits as a last unit.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..base import StoreError
from ..writer_thread import Job, Outcome, WriterThread
from ._fs import DatasetFS
from ._layout import COMMIT_LIMIT_S, TABLES, Marker, new_unit_name, table_bytes, unit_files

__all__ = ["UnitRows", "UnitWriter", "Work"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class UnitRows:
    """Rows bound for one unit, and the keys they add (what later work of the batch must see)."""

    rows: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {t: [] for t in TABLES})
    #: staged call id -> (rollout id, prompt + completion)
    calls: dict[str, tuple[str, array[int]]] = field(default_factory=dict)
    blobs: set[str] = field(default_factory=set)
    attachments: set[str] = field(default_factory=set)
    rollouts: set[str] = field(default_factory=set)
    #: rollouts whose seal event is in this batch: the writer forgets their calls once it commits
    sealed: set[str] = field(default_factory=set)

    def merge(self, other: UnitRows) -> None:
        for table, rows in other.rows.items():
            self.rows[table].extend(rows)
        self.calls.update(other.calls)
        self.blobs |= other.blobs
        self.attachments |= other.attachments
        self.rollouts |= other.rollouts
        self.sealed |= other.sealed

    def empty(self) -> bool:
        return not any(self.rows.values())


#: A piece of work: runs on the writer thread; reads the batch so far, adds its rows to `part`.
Work = Callable[["UnitRows", "UnitRows"], Any]


class UnitWriter(WriterThread[Work]):
    """Commits submitted work to `dfs` in units; `publish` sees each committed batch's rows."""

    kind = "parquet"

    def __init__(
        self,
        dfs: DatasetFS,
        *,
        name: str,
        max_batch: int,
        last_order: int,
        publish: Callable[[UnitRows], None],
        settle: Callable[[list[Work]], None] | None = None,
        linger_s: float = 0.0,
        linger_capped: bool = True,
    ) -> None:
        super().__init__(
            name=name, max_batch=max_batch, linger_s=linger_s, linger_capped=linger_capped
        )
        self.dfs = dfs
        self.last_order = last_order
        self._publish = publish
        self._settle = settle
        #: Rows of deferred work waiting for the next unit written (module docstring).
        self._waiting = UnitRows()
        self.start()

    def _lingers(self, jobs: list[Job[Work]]) -> bool:
        # Deferred work (admission claims) alone writes no unit: its callers, about to send
        # their calls upstream, are answered at once.
        return not all(getattr(job.work, "defer", False) for job in jobs)

    def _commit(self, jobs: list[Job[Work]]) -> None:
        if self._settle is not None:
            # What the batch's work needs from the store before it runs (the sink's seq claims,
            # written at once); a failure here is each piece's own, when it asks.
            try:
                self._settle([job.work for job in jobs])
            except Exception:
                log.exception("%s: settling a batch's claims failed", self.name)
        # The rows waiting for a unit go first: later work of the batch chains after them.
        batch, self._waiting = self._waiting, UnitRows()
        held = not batch.empty()
        outcomes: list[Outcome] = []
        wrote: list[bool] = []
        for job in jobs:
            part = UnitRows()
            try:
                value = job.work(batch, part)
            except Exception as e:  # this job fails alone: its part is dropped
                outcomes.append((job.future, None, e))
                wrote.append(False)
            else:
                batch.merge(part)
                outcomes.append((job.future, value, None))
                # Deferred work's caller is answered whatever becomes of the unit.
                deferred = bool(getattr(job.work, "defer", False))
                held = held or (deferred and not part.empty())
                wrote.append(not deferred and not part.empty())
        if not any(wrote):
            self._waiting = batch  # deferred rows alone (or nothing): they wait for a unit
        else:
            try:
                self._write_unit(batch)
            except BaseException as e:
                # BaseException too: whatever stops this unit, every caller whose rows were in
                # it must hear it (a refused record or a failed job keeps its own outcome).
                err = StoreError(
                    f"committing to {self.name} failed ({type(e).__name__}: {e}); nothing of "
                    "this batch was stored"
                )
                err.__cause__ = e
                if held:
                    log.warning(
                        "%s: the failed unit took the waiting claim events with it; their "
                        "claims stand, without events, as after a crash",
                        self.name,
                    )
                outcomes = [
                    (f, None, err) if w else (f, v, error)
                    for (f, v, error), w in zip(outcomes, wrote, strict=True)
                ]
            else:
                self._committed(jobs)
                try:
                    self._publish(batch)
                except Exception:  # a cache update must not turn committed work into an error
                    log.exception("%s: publishing a committed unit failed", self.name)
        self._deliver(jobs, outcomes)

    def _on_exit(self) -> None:
        if self._waiting.empty():
            return
        waiting, self._waiting = self._waiting, UnitRows()
        try:  # `close`: what deferred work left waiting becomes a last unit
            self._write_unit(waiting)
            self._publish(waiting)
        except Exception as e:
            log.warning(
                "%s: the last unit, of waiting claim events, failed (%s: %s); their claims "
                "stand, without events, as after a crash",
                self.name,
                type(e).__name__,
                e,
            )

    def _write_unit(self, batch: UnitRows) -> None:
        unit, order = new_unit_name(self.last_order)
        tables = [t for t in TABLES if batch.rows[t]]
        files = unit_files(unit, tables)
        data = {files[t]: table_bytes(t, batch.rows[t]) for t in tables}
        marker = Marker(
            unit=unit,
            files=files,
            rows={t: len(batch.rows[t]) for t in tables},
            created_at_ms=int(time.time() * 1000),
            size=sum(map(len, data.values())),
        )
        try:
            self.dfs.put_all(data)
            self.dfs.put_all({marker.rel: marker.encode()})
            took_s = (time.time_ns() - order) / 1e9
            if took_s > COMMIT_LIMIT_S:
                # A maintenance run's checkpoint may have been written meanwhile, with a
                # horizon after this name: readers that list after it would not see the unit.
                raise StoreError(
                    f"the unit {unit} took {took_s:.0f} s to commit, more than "
                    f"{COMMIT_LIMIT_S:.0f} s (the store or this host stalled): it was retracted"
                )
        except BaseException:
            # Retract whatever landed, marker first: a unit whose marker is gone does not exist,
            # and its files are then plain leftovers (compaction removes them).
            for rel in (marker.rel, *data):
                try:
                    self.dfs.delete(rel)
                except Exception as e:
                    log.warning("%s: could not remove %s of a failed unit: %s", self.name, rel, e)
            raise
        self.last_order = order
