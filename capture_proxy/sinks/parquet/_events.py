"""The event log of a Parquet dataset: ``event`` rows in the units' ``ledger/`` files.

Events go into the unit of the group commit that writes what they record, as rows of the ledger
table (kind ``event``), not into files of their own: a ``staged`` event then commits with its
record and a ``ledger`` event with its ledger entry, under one marker, so the chain never says
more or less than the dataset holds. Readers already replay ledger rows in commit order, which is
the chain's order for each rollout.

The writer places each event after its rollout's head: the last event committed (`EventHeads`,
loaded at open and advanced as units commit) or an earlier event of the same unit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from ...schemas.events import EventDraft, EventKind, RolloutEvent, chain_event
from ._layout import LEDGER
from ._writer import UnitRows

__all__ = ["EventHeads", "event_from_row", "event_row"]

#: Sealed rollouts whose chain heads a writer keeps (`EventHeads.retire`): about 0.2 KB each.
SEALED_HEADS = 4096


def event_row(event: RolloutEvent) -> dict[str, Any]:
    return {
        "kind": "event",
        "rollout_id": event.rollout_id,
        "call_id": event.call_id,
        "seq": event.seq,
        "at_ms": event.at_ms,
        "event_kind": event.kind,
        "position": event.position,
        "body": orjson.dumps(dict(event.body), option=orjson.OPT_SORT_KEYS),
        "prev_hash": event.prev_hash,
        "hash": event.hash,
    }


def event_from_row(row: Mapping[str, Any]) -> RolloutEvent:
    body = orjson.loads(row["body"] or b"{}")
    if not isinstance(body, dict):  # a crafted file: a body is always a JSON object
        raise TypeError(f"an event's body is JSON {type(body).__name__}, not an object")
    return RolloutEvent(
        row["rollout_id"],
        int(row["position"]),
        row["event_kind"],
        row["seq"],
        row["call_id"],
        int(row["at_ms"] or 0),
        body,
        row["prev_hash"] or "",
        row["hash"] or "",
    )


class EventHeads:
    """Each rollout's last committed event, as (position, hash). Writer thread only.

    A head is dropped once its rollout's ``seal`` event (or a sealed header) commits, but for
    the last `SEALED_HEADS` sealed: a sealed rollout takes few more events and headers (its
    sealed header, an outcome's), and a writer living as long as a proxy would otherwise hold
    one per rollout it ever wrote. `lookup` finds a head not held (None: the rollout has no
    event yet).
    """

    def __init__(
        self,
        heads: Mapping[str, tuple[int, str]],
        lookup: Callable[[str], tuple[int, str] | None] = lambda _: None,
    ) -> None:
        self._heads = dict(heads)
        self._lookup = lookup
        #: The heads of the rollouts sealed last (`retire`), `SEALED_HEADS` at most: the proxy
        #: writes a sealed header right after the seal event, and an outcome's event and header
        #: soon after, and each needs the head (read from the store otherwise).
        self._sealed: OrderedDict[str, tuple[int, str]] = OrderedDict()

    def place(self, batch: UnitRows, part: UnitRows, draft: EventDraft) -> RolloutEvent:
        """Chain `draft` after its rollout's head and add its row to `part`."""
        event = chain_event(draft, self.head(batch, part, draft.rollout_id))
        part.rows[LEDGER].append(event_row(event))
        return event

    def head(self, batch: UnitRows, part: UnitRows, rollout_id: str) -> tuple[int, str] | None:
        """The last event of `rollout_id` placed so far (in `part`, `batch` or committed)."""
        placed = _last_in(part, rollout_id) or _last_in(batch, rollout_id)
        return placed or self.committed(rollout_id)

    def committed(self, rollout_id: str) -> tuple[int, str] | None:
        """The last committed event of `rollout_id` (None: it has none)."""
        return (
            self._heads.get(rollout_id) or self._sealed.get(rollout_id) or self._lookup(rollout_id)
        )

    def reset(self, rollout_id: str, head: tuple[int, str] | None) -> None:
        """Continue `rollout_id`'s chain after `head`, as the store has it now (another writer
        may have appended since this one last did)."""
        self._sealed.pop(rollout_id, None)
        if head is None:
            self._heads.pop(rollout_id, None)
        else:
            self._heads[rollout_id] = head

    def publish(self, batch: UnitRows) -> None:
        """Advance the heads past a committed unit's events."""
        for row in _events_in(batch.rows[LEDGER]):
            self._sealed.pop(row["rollout_id"], None)
            self._heads[row["rollout_id"]] = (row["position"], row["hash"])
            if row["event_kind"] == EventKind.SEAL:
                self.retire(row["rollout_id"])

    def retire(self, rollout_id: str) -> None:
        """Hold `rollout_id`'s head among the last `SEALED_HEADS` sealed only (its seal
        committed): read from the store once it falls out."""
        head = self._heads.pop(rollout_id, None)
        if head is not None:
            self._sealed[rollout_id] = head
            while len(self._sealed) > SEALED_HEADS:
                self._sealed.popitem(last=False)


def _events_in(rows: Iterable[Mapping[str, Any]]) -> Iterable[Mapping[str, Any]]:
    return (r for r in rows if r["kind"] == "event")


def _last_in(rows: UnitRows, rollout_id: str) -> tuple[int, str] | None:
    # A batch holds at most a few hundred rows: a scan beats keeping a second map in step.
    for row in reversed(rows.rows[LEDGER]):
        if row["kind"] == "event" and row["rollout_id"] == rollout_id:
            return (row["position"], row["hash"])
    return None
