"""Which rollouts go into a consumer's next batch, and the consumer's durable place.

`BatchQueue` is the one implementation of the batch API's rules: a trainer's `Store.batches` runs
it on a local store, and a proxy's read routes run it on the proxy's store for trainers reading
remotely. A consumer's place is an `ExportCursor` kept in the store under the consumer's name
(`capture_proxy.sinks.cursors`): the rollouts it acknowledged (``taken``), the batch delivered
and not acknowledged (``pending``, handed out again until acknowledged), and the rollouts it will
never get, with why (``passed``).

A rollout is a candidate when the rollout index (`capture_proxy.sinks.rollout_index`) lists it
sealed and graded and the consumer's cursor has not seen it. Each candidate is then read the way
a trainer reads one: its status (`Store.status`: poisoned, lost in a crash), its calls' weight
versions (staleness), and its trajectory through the reader's verified read
(`Store.trajectory(..., verify=True)`), whatever "verified" means there. A candidate failing any
of these is passed, with its reason, once; the reasons reach the trainer in the next batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import CaptureProxyError
from ..sinks.base import PROXY_STATE_ROLLOUT, StagingSource, StoreDamaged, StoreError
from ..sinks.cursors import CursorHolder, CursorStorage, check_consumer
from ..sinks.rollout_index import IndexedRollout, RolloutQuery, indexed
from .cursor import CursorInvalid, ExportCursor
from .status import RolloutExcluded

if TYPE_CHECKING:
    from .reader import Store
    from .trajectory import Trajectory

__all__ = ["BatchPlan", "BatchQueue", "BatchRequest", "BatchUnknown", "Skipped"]

#: A poll reads rollouts sealed from this long before the consumer's horizon: a seal that
#: becomes visible this late after the last pass is still found by the next one.
LATE_MS = 60_000
#: Every this many seconds a poll reads every sealed rollout (`BatchQueue._unseen`).
FULL_PASS_S = 60.0


def driver_weight_version(source: StagingSource) -> int | None:
    """The weight version the driver last set on the proxy (``PUT /admin/weight-version``), as
    `capture_proxy.core.weights` keeps it in the store; None when none was set."""
    try:
        value = source.rollout_info(PROXY_STATE_ROLLOUT).metadata.get("weight_version")
    except KeyError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class BatchUnknown(CaptureProxyError):
    """An acknowledgement names a batch the consumer was not handed (or not this one)."""


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """What a consumer asks for: `rollouts` rollouts, or `groups` complete groups of
    `group_size` (exactly one of the two); rollouts older than `max_staleness` weight versions
    behind `current_version` (default: the version the driver last set on the proxy) are
    skipped."""

    rollouts: int | None = None
    groups: int | None = None
    group_size: int | None = None
    max_staleness: int | None = None
    current_version: int | None = None

    def __post_init__(self) -> None:
        if (self.rollouts is None) == (self.groups is None):
            raise ValueError("ask for rollouts=N or groups=N (one of the two)")
        for name in ("rollouts", "groups", "group_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if self.groups is not None and self.group_size is None:
            raise ValueError(
                "groups=N needs group_size: a group is complete when that many of its rollouts "
                "are sealed and graded"
            )
        for name in ("max_staleness", "current_version"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, not {value!r}")

    def to_dict(self) -> dict[str, int | None]:
        return {
            "rollouts": self.rollouts,
            "groups": self.groups,
            "group_size": self.group_size,
            "max_staleness": self.max_staleness,
            "current_version": self.current_version,
        }


@dataclass(frozen=True, slots=True)
class Skipped:
    """A rollout the consumer will never be handed, and why. `reason` is one of ``poisoned``,
    ``stale``, ``unverified``, ``empty`` (no staged call), ``gone`` (removed from the store),
    ``no_group`` (a groups consumer: its outcome names no group), ``group_excluded`` (a member
    of its group was skipped), ``group_closed`` (its group was already delivered or left
    out); `detail` says more, for people."""

    rollout_id: str
    reason: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"rollout_id": self.rollout_id, "reason": self.reason, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """A batch as recorded in the consumer's cursor: its id, rollouts (group after group when
    it is a batch of groups), the rollouts skipped since the previous batch, the weight version
    staleness was measured against, and whether it was delivered before (not acknowledged)."""

    consumer: str
    batch_id: str
    rollout_ids: tuple[str, ...]
    groups: dict[str, list[str]] = field(default_factory=dict)
    skipped: tuple[Skipped, ...] = ()
    current_version: int | None = None
    redelivered: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "batch_id": self.batch_id,
            "rollout_ids": list(self.rollout_ids),
            "groups": self.groups,
            "skipped": [s.to_dict() for s in self.skipped],
            "current_version": self.current_version,
            "redelivered": self.redelivered,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any], *, redelivered: bool | None = None) -> BatchPlan:
        return cls(
            consumer=str(doc["consumer"]),
            batch_id=str(doc["batch_id"]),
            rollout_ids=tuple(doc["rollout_ids"]),
            groups={str(g): list(m) for g, m in (doc.get("groups") or {}).items()},
            skipped=tuple(Skipped(**s) for s in doc.get("skipped") or ()),
            current_version=doc.get("current_version"),
            redelivered=bool(doc.get("redelivered")) if redelivered is None else redelivered,
        )


class BatchQueue:
    """Batches of one store for any number of consumers (thread-safe)."""

    def __init__(self, store: Store, storage: CursorStorage | None = None) -> None:
        self.store = store
        if storage is None:
            source = store.source
            if not isinstance(source, CursorHolder):
                raise StoreError(f"{store.url} cannot keep consumer cursors (no batch API)")
            storage = source.consumer_cursors()
        self.storage = storage
        self._lock = threading.Lock()
        #: consumer -> rollouts verified while waiting for a full batch (bounded by its size)
        self._ready: dict[str, dict[str, Trajectory]] = {}
        #: consumer -> (its horizon: a seal time, ms; when its last full pass was, monotonic s)
        self._horizon: dict[str, tuple[int, float]] = {}

    def _load(self, consumer: str) -> tuple[ExportCursor, int]:
        found = self.storage.load(consumer)
        if found is None:
            return ExportCursor(), 0
        body, revision = found
        try:
            return ExportCursor.from_json(body, where=f"consumer {consumer!r}'s cursor"), revision
        except CursorInvalid as e:
            raise StoreError(str(e)) from e

    def position(self, consumer: str) -> dict[str, Any]:
        """The consumer's place (JSON-ready): rollouts taken (acknowledged) and passed, batches
        delivered, the pending batch, and the rollouts skipped since the last batch (`skipped`,
        reported with the next one)."""
        cursor, revision = self._load(check_consumer(consumer))
        return {
            "consumer": consumer,
            "taken": len(cursor),
            "passed": len(cursor.passed),
            "batches": cursor.batches,
            "pending": cursor.pending,
            "skipped": cursor.unreported,
            "revision": revision,
        }

    def next(
        self, consumer: str, request: BatchRequest, *, read: bool = True
    ) -> tuple[BatchPlan, list[Trajectory]] | None:
        """The consumer's next batch, or None when not enough rollouts are ready (no wait).

        The batch pending (delivered, not acknowledged) comes again, whatever `request` says.
        Otherwise a new batch is recorded in the store before it is returned. With `read`
        false, the trajectories of a batch delivered again are not read (a proxy serving a
        remote trainer, which reads them itself).
        """
        check_consumer(consumer)
        with self._lock:
            cursor, revision = self._load(consumer)
            if cursor.pending is not None:
                plan = BatchPlan.from_dict(cursor.pending, redelivered=True)
                # Read as delivered the first time: verified (raises if that no longer holds).
                read_one = self.store.trajectory
                return plan, [read_one(r, verify=True) for r in plan.rollout_ids] if read else []
            current = request.current_version
            if current is None and request.max_staleness is not None:
                current = driver_weight_version(self.store.source)
            ready = self._ready.setdefault(consumer, {})
            unseen = self._unseen(consumer, cursor)
            said = len(cursor.unreported)
            rows = [r for r in unseen if r.graded]
            chosen, groups = self._choose(cursor, rows, request, current, ready)
            self._advance(consumer, cursor, unseen, chosen or ())
            if chosen is None:
                if len(cursor.unreported) > said:  # new skips: recorded once, said later
                    self._save(consumer, cursor, revision)
                return None
            cursor.batches += 1
            plan = BatchPlan(
                consumer,
                f"{consumer}:{cursor.batches}",
                tuple(chosen),
                groups,
                tuple(Skipped(**s) for s in cursor.unreported),
                current,
            )
            for group_id in groups:
                cursor.closed_groups[group_id] = "delivered"
            cursor.pending = plan.to_dict()
            cursor.unreported = []
            self._save(consumer, cursor, revision)
            trajectories = [ready.pop(r) for r in chosen]
            return plan, trajectories

    def ack(self, consumer: str, batch_id: str) -> int:
        """Record the batch as used: its rollouts are never delivered to `consumer` again.
        Returns how many were acknowledged (0 for a batch acknowledged before). Raises
        `BatchUnknown` for a batch the consumer was not handed."""
        check_consumer(consumer)
        with self._lock:
            cursor, revision = self._load(consumer)
            pending = cursor.pending
            if pending is not None and pending["batch_id"] == batch_id:
                cursor.add(pending["rollout_ids"])
                cursor.pending = None
                self._save(consumer, cursor, revision)
                return len(pending["rollout_ids"])
            number = batch_id.removeprefix(f"{consumer}:")
            if number.isdigit() and 0 < int(number) <= cursor.batches and number != batch_id:
                return 0  # acknowledged before: an ack sent again after its answer was lost
            raise BatchUnknown(
                f"consumer {consumer!r} was not handed batch {batch_id!r} "
                f"(its pending batch: {None if pending is None else pending['batch_id']!r})"
            )

    def _unseen(self, consumer: str, cursor: ExportCursor) -> list[IndexedRollout]:
        """The sealed rollouts the cursor has not seen, graded or not, oldest first.

        Read from the consumer's horizon on (the earliest seal time not seen at its last pass,
        less `LATE_MS`), so a poll costs the rollouts sealed since, not the store; every
        `FULL_PASS_S` (and at the first poll) from the start, which finds rollouts whose seal
        became visible later than that (another proxy's unit, a clock behind)."""
        held = self._horizon.get(consumer)
        full = held is None or time.monotonic() - held[1] >= FULL_PASS_S
        since = None if full or held is None else held[0] - LATE_MS
        if full:
            self._horizon[consumer] = (held[0] if held else 0, time.monotonic())
        query = RolloutQuery(state="sealed", since_ms=since, with_poisoned=True)
        return [r for r in indexed(self.store.source, query) if not cursor.seen(r.rollout_id)]

    def _advance(
        self,
        consumer: str,
        cursor: ExportCursor,
        unseen: Sequence[IndexedRollout],
        chosen: Sequence[str],
    ) -> None:
        """Move the consumer's horizon to the earliest seal time still not seen (or past the
        last one seen when none is left)."""
        taken = set(chosen)
        left = [
            r.sealed_at_ms or 0
            for r in unseen
            if r.rollout_id not in taken and not cursor.seen(r.rollout_id)
        ]
        held = self._horizon[consumer]
        newest = max((r.sealed_at_ms or 0 for r in unseen), default=held[0])
        self._horizon[consumer] = (min(left) if left else max(newest, held[0]), held[1])

    def _save(self, consumer: str, cursor: ExportCursor, revision: int) -> None:
        self.storage.save(consumer, cursor.to_json(), revision)

    def _choose(
        self,
        cursor: ExportCursor,
        rows: Sequence[IndexedRollout],
        request: BatchRequest,
        current: int | None,
        ready: dict[str, Trajectory],
    ) -> tuple[list[str] | None, dict[str, list[str]]]:
        def check(rollout_id: str) -> Trajectory | Skipped:
            got = ready.get(rollout_id)
            if got is not None:
                return got
            checked = self._check(rollout_id, request.max_staleness, current)
            if not isinstance(checked, Skipped):
                ready[rollout_id] = checked
            return checked

        def skip(s: Skipped) -> None:
            cursor.passed[s.rollout_id] = s.reason
            cursor.unreported.append(s.to_dict())
            ready.pop(s.rollout_id, None)

        if request.rollouts is not None:
            chosen: list[str] = []
            for row in rows:
                got = check(row.rollout_id)
                if isinstance(got, Skipped):
                    skip(got)
                    continue
                chosen.append(row.rollout_id)
                if len(chosen) == request.rollouts:
                    return chosen, {}
            return None, {}
        assert request.groups is not None
        assert request.group_size is not None
        members: dict[str, list[str]] = {}
        for row in rows:
            if row.group_id is None:
                skip(Skipped(row.rollout_id, "no_group", "its outcome names no group_id"))
            elif row.group_id in cursor.closed_groups:
                why = cursor.closed_groups[row.group_id]
                skip(Skipped(row.rollout_id, "group_closed", f"group {row.group_id}: {why}"))
            else:
                members.setdefault(row.group_id, []).append(row.rollout_id)
        groups: dict[str, list[str]] = {}
        for group_id, ids in members.items():
            if len(ids) < request.group_size:
                continue  # not complete yet
            ids = ids[: request.group_size]  # later members find the group closed
            checked = [(r, check(r)) for r in ids]
            bad = [(r, c) for r, c in checked if isinstance(c, Skipped)]
            if bad:
                first = bad[0][1]
                assert isinstance(first, Skipped)
                why = f"member {first.rollout_id} is {first.reason}: {first.detail}"
                cursor.closed_groups[group_id] = f"left out: {why}"
                for r, c in checked:
                    skip(c if isinstance(c, Skipped) else Skipped(r, "group_excluded", why))
                continue
            groups[group_id] = ids
            if len(groups) == request.groups:
                return [r for ids in groups.values() for r in ids], groups
        return None, {}

    def _check(
        self, rollout_id: str, max_staleness: int | None, current: int | None
    ) -> Trajectory | Skipped:
        """The rollout's verified trajectory, or why a trainer must not get it."""
        try:
            status = self.store.status(rollout_id)
            if status.poisoned:
                bad = [e for e in status.not_staged if e.poisons]
                what = ", ".join(f"{e.call_id} (seq {e.seq}) {e.status}: {e.reason}" for e in bad)
                return Skipped(rollout_id, "poisoned", what or "flagged in its header")
            if max_staleness is not None and current is not None:
                versions = [s.weight_version for s in self.store.source.summaries(rollout_id)]
                oldest = min(versions, default=current)
                if oldest < current - max_staleness:
                    return Skipped(
                        rollout_id,
                        "stale",
                        f"weight version {oldest} is older than {current} - {max_staleness}",
                    )
        except KeyError:
            return Skipped(rollout_id, "gone", "no longer in the store")
        return self._verified(rollout_id)

    def _verified(self, rollout_id: str) -> Trajectory | Skipped:
        try:
            traj = self.store.trajectory(rollout_id, verify=True)
        except StoreDamaged as e:  # its ledger or event log holds what no writer writes
            return Skipped(rollout_id, "unverified", str(e))
        except StoreError:
            raise  # the store cannot be read now: nothing is decided about the rollout
        except RolloutExcluded as e:
            # `RolloutUnverified` (keyword ``verify``): read/integrity.py's "verified" fails.
            reason = {"include_poisoned": "poisoned", "verify": "unverified"}.get(e.keyword, "open")
            return Skipped(rollout_id, reason, str(e))
        except KeyError:
            return Skipped(rollout_id, "gone", "no longer in the store")
        except (CaptureProxyError, ValueError) as e:
            return Skipped(rollout_id, "unverified", f"{type(e).__name__}: {e}")
        if not traj.calls:
            return Skipped(rollout_id, "empty", "no staged call")
        return traj
