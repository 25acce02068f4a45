"""The rollout ledger of a Parquet dataset: rows in ``ledger/<unit>.parquet``, replayed in order.

Four kinds of row share one table: ``rollout`` (a header written by `put_rollout`, or implicitly
when a rollout's first call or failure arrives), ``failure`` (a call that was not staged),
``orphan`` (a staged record whose write landed after its caller gave up) and ``event`` (an event
of a rollout's log, `_events`). Rows are never updated in
place: a later ``rollout`` row for the same id replaces the earlier header when replayed, except
an *implicit* one (``reason`` ``implicit``: what a writer adds when a rollout's first call or
failure reaches it), which never replaces a header already replayed: with several writers on one
dataset, a writer that meets a rollout another created must not reset its metadata or key.
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


def rollout_row(info: RolloutInfo) -> dict[str, Any]:
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

    def apply(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            kind = row["kind"]
            if kind == "rollout":
                if row.get("reason") == IMPLICIT and row["rollout_id"] in self.rollouts:
                    continue
                metadata, outcomes = split_header_metadata(orjson.loads(row["metadata"] or b"{}"))
                self.rollouts[row["rollout_id"]] = RolloutInfo(
                    rollout_id=row["rollout_id"],
                    state=RolloutState(row["state"]),
                    poisoned=bool(row["poisoned"]),
                    created_at_ms=int(row["at_ms"] or 0),
                    sealed_at_ms=row["sealed_at_ms"],
                    metadata=metadata,
                    policy=orjson.loads(row["policy"] or b"{}"),
                    outcome_history=outcomes,
                )
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
