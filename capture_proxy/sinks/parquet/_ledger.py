"""The rollout ledger of a Parquet dataset: rows in ``ledger/<unit>.parquet``, replayed in order.

Four kinds of row share one table: ``rollout`` (a header written by `put_rollout`, or implicitly
when a rollout's first call or failure arrives), ``failure`` (a call that was not staged),
``orphan`` (a staged record whose write landed after its caller gave up) and ``event`` (an event
of a rollout's log, `_events`). Rows are never updated in
place: a later ``rollout`` row for the same id replaces the earlier header when replayed, except
an *implicit* one (``reason`` ``implicit``: what a writer adds when a rollout's first call or
failure reaches it), which never replaces a header already replayed: with several writers on one
dataset, a writer that meets a rollout another created must not reset its metadata or key.

A header row's ``position`` is its *revision*: the position of its rollout's last event when the
header was written (-1 before any event). Unit order alone cannot date a header: with several
writers, a compaction's merged unit takes its last unit's order, so a header committed after the
compaction listed the units can sort before an older header in the merged unit. So a header
replaces the replayed one only if it is not older: a lower revision is older; at one revision a
sealed header is newer than an open one, then one with more outcomes is newer (a rollout never
reopens and its outcome history only grows); otherwise the later in unit order wins. A header
written before revisions (``position`` null) replaces as before, whatever it follows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import orjson

from ...schemas.events import RolloutEvent
from ...schemas.outcome import header_metadata, split_header_metadata
from ...schemas.records import CallStatus, LedgerEntry, RolloutInfo, RolloutState
from ._events import event_from_row

__all__ = ["IMPLICIT", "LedgerState", "failure_row", "orphan_row", "rollout_row"]

#: The ``reason`` of a header row a writer adds implicitly (see the module docstring).
IMPLICIT = "implicit"


def rollout_row(info: RolloutInfo, revision: int | None = None) -> dict[str, Any]:
    """A header row; `revision` is the position of the rollout's last event (module docstring)."""
    return {
        "kind": "rollout",
        "rollout_id": info.rollout_id,
        "state": str(info.state),
        "poisoned": info.poisoned,
        "at_ms": info.created_at_ms,
        "sealed_at_ms": info.sealed_at_ms,
        "metadata": orjson.dumps(
            header_metadata(info.metadata, info.outcome_history), option=orjson.OPT_SORT_KEYS
        ),
        "policy": orjson.dumps(dict(info.policy), option=orjson.OPT_SORT_KEYS),
        "position": revision,
    }


def failure_row(entry: LedgerEntry) -> dict[str, Any]:
    return {
        "kind": "failure",
        "rollout_id": entry.rollout_id,
        "call_id": entry.call_id,
        "seq": entry.seq,
        "status": str(entry.status),
        "reason": entry.reason,
        "message": entry.message,
        "http_status": entry.http_status,
        "at_ms": entry.at_ms,
    }


def orphan_row(call_id: str, rollout_id: str | None, reason: str, at_ms: int) -> dict[str, Any]:
    return {
        "kind": "orphan",
        "rollout_id": rollout_id,
        "call_id": call_id,
        "reason": reason,
        "at_ms": at_ms,
    }


class LedgerState:
    """Ledger state folded from rows in commit order."""

    def __init__(self) -> None:
        #: Insertion order is first appearance: `rollouts()` lists oldest first.
        self.rollouts: dict[str, RolloutInfo] = {}
        self.failures: dict[str, list[LedgerEntry]] = {}
        #: call id -> (rollout id if known when marked, reason)
        self.orphans: dict[str, tuple[str | None, str]] = {}
        #: rollout id -> its event log, in commit order
        self.events: dict[str, list[RolloutEvent]] = {}
        #: rollout id -> how new its replayed header is (`_age`); absent: written before
        #: revisions, or implicit
        self._ages: dict[str, tuple[int, bool, int]] = {}

    def apply(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            kind = row["kind"]
            if kind == "rollout":
                if row.get("reason") == IMPLICIT and row["rollout_id"] in self.rollouts:
                    continue
                metadata, outcomes = split_header_metadata(orjson.loads(row["metadata"] or b"{}"))
                info = RolloutInfo(
                    rollout_id=row["rollout_id"],
                    state=RolloutState(row["state"]),
                    poisoned=bool(row["poisoned"]),
                    created_at_ms=int(row["at_ms"] or 0),
                    sealed_at_ms=row["sealed_at_ms"],
                    metadata=metadata,
                    policy=orjson.loads(row["policy"] or b"{}"),
                    outcome_history=outcomes,
                )
                revision = row.get("position")  # absent from files written before event logs
                if revision is None or row.get("reason") == IMPLICIT:
                    self._ages.pop(info.rollout_id, None)
                else:
                    age = _age(int(revision), info)
                    replayed = self._ages.get(info.rollout_id)
                    if replayed is not None and age < replayed:
                        continue  # older than the header replayed: committed late, not written so
                    self._ages[info.rollout_id] = age
                self.rollouts[info.rollout_id] = info
            elif kind == "failure":
                self.failures.setdefault(row["rollout_id"], []).append(
                    LedgerEntry(
                        rollout_id=row["rollout_id"],
                        call_id=row["call_id"],
                        seq=int(row["seq"]),
                        status=CallStatus(row["status"]),
                        reason=row["reason"],
                        message=row["message"],
                        http_status=row["http_status"],
                        at_ms=int(row["at_ms"] or 0),
                    )
                )
            elif kind == "orphan":
                self.orphans[row["call_id"]] = (row["rollout_id"], row["reason"])
            elif kind == "event":
                self.events.setdefault(row["rollout_id"], []).append(event_from_row(row))

    def info(self, rollout_id: str, orphaned_here: bool) -> RolloutInfo:
        """The header, poisoned by a capture failure or an orphaned record of the rollout."""
        info = self.rollouts[rollout_id]
        failed = any(
            f.status is CallStatus.CAPTURE_FAILED for f in self.failures.get(rollout_id, ())
        )
        return replace(info, poisoned=info.poisoned or failed or orphaned_here)

    def failures_of(self, rollout_id: str) -> list[LedgerEntry]:
        # sorted() is stable: failures with the same seq keep the order they were recorded in.
        return sorted(self.failures.get(rollout_id, ()), key=lambda f: f.seq)


def _age(revision: int, info: RolloutInfo) -> tuple[int, bool, int]:
    """How new a header is among its rollout's (module docstring): higher is newer."""
    return (revision, info.state is RolloutState.SEALED, len(info.outcome_history))
