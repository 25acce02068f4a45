"""The per-rollout event log: admission claims, outcomes, ledger entries and seals, hash-chained.

Every rollout has its own append-only list of events. Each event names its place in the list
(`RolloutEvent.position`, from 0) and carries the hash of the event before it (`prev_hash`; the
empty string for the first), so deleting or editing an event breaks the chain at a position
`check_chain` names. The chain is per rollout, not global: several writers append to different
rollouts without coordinating.

Event kinds (`EventKind`):

* ``claim``: a call was admitted at this seq (written at admission, before the call's final
  status). A store holds at most one claim per ``(rollout, seq)``: a second is refused
  (`DuplicateSeq`), which is what keeps a rollout handed to another proxy from reusing a seq.
* ``staged``: the call's record was staged (body: its ``digest``), written with the record.
* ``ledger``: the call is in the rollout's ledger (body: ``status``, ``reason``, ``message``,
  ``http_status``), written with the ledger entry.
* ``seal``: the rollout was sealed.
* ``token_in``: the rollout's token-in choice, given when it was created (body:
  ``{"token_in": true|false}``; no event: the proxy's ``--token-in`` setting decides).
* ``replica``: the rollout was pinned to an upstream replica (body: ``replica``, and
  ``moved_from`` when it moved from another); see docs/fleets.md.
* ``outcome``, ``handoff``: reserved for later releases; a reader checks their
  place in the chain like any other.

A claim with neither a ``staged`` event nor a ledger entry is ``lost_in_crash``: the call was
admitted and the proxy stopped before it ended (or its record was removed). docs/digest.md
describes the hash's canonical encoding byte by byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .digest import encode_value
from .records import LedgerEntry, StagedCallRecord

__all__ = [
    "EVENT_DOMAIN",
    "EVENT_FIELDS",
    "ChainBreak",
    "EventDraft",
    "EventKind",
    "RolloutEvent",
    "chain_event",
    "chain_head",
    "check_chain",
    "claim_event",
    "event_hash",
    "ledger_event",
    "staged_event",
    "token_in_choice",
    "token_in_event",
]

#: Domain prefix of an event's hash (docs/digest.md, "The event log").
EVENT_DOMAIN = b"capture-proxy:event:v1\x00"
#: The fields an event's hash covers, in this order (each as its name, then its value).
EVENT_FIELDS = ("rollout_id", "position", "kind", "seq", "call_id", "at_ms", "body", "prev_hash")


class EventKind(StrEnum):
    CLAIM = "claim"
    STAGED = "staged"
    LEDGER = "ledger"
    SEAL = "seal"
    #: The rollout's token-in choice (`token_in_event`).
    TOKEN_IN = "token_in"
    #: Reserved for later releases (rollout outcome, handoff); ``replica`` is the rollout's
    #: upstream replica pin (written by ``capture_proxy.core.pins``).
    OUTCOME = "outcome"
    REPLICA = "replica"
    HANDOFF = "handoff"


@dataclass(frozen=True, slots=True)
class EventDraft:
    """An event before a store places it in its rollout's chain (`chain_event`).

    `body` holds JSON values only (strings, integers, booleans, None, lists, string-keyed maps):
    stores keep it as JSON and the hash is over its canonical encoding.
    """

    rollout_id: str
    kind: EventKind
    at_ms: int
    seq: int | None = None
    call_id: str | None = None
    body: Mapping[str, Any] = field(default_factory=dict)


def claim_event(rollout_id: str, seq: int, call_id: str, at_ms: int) -> EventDraft:
    """The admission claim of `seq` for `call_id`."""
    return EventDraft(rollout_id, EventKind.CLAIM, at_ms, seq, call_id)


def staged_event(record: StagedCallRecord, at_ms: int) -> EventDraft:
    """What a store appends with a staged record: its seq, call and digest."""
    return EventDraft(
        record.rollout_id,
        EventKind.STAGED,
        at_ms,
        record.seq,
        record.call_id,
        {"digest": record.digest},
    )


def ledger_event(entry: LedgerEntry) -> EventDraft:
    """What a store appends with a ledger entry: the entry's fields."""
    return EventDraft(
        entry.rollout_id,
        EventKind.LEDGER,
        entry.at_ms,
        entry.seq,
        entry.call_id,
        {
            "status": entry.status.value,
            "reason": entry.reason,
            "message": entry.message,
            "http_status": entry.http_status,
        },
    )


def token_in_event(rollout_id: str, token_in: bool, at_ms: int) -> EventDraft:
    """The rollout's token-in choice, written when it is created with ``token_in`` set."""
    return EventDraft(rollout_id, EventKind.TOKEN_IN, at_ms, body={"token_in": token_in})


def token_in_choice(events: Sequence[RolloutEvent]) -> bool | None:
    """The rollout's token-in choice as its event log has it (the latest ``token_in`` event),
    or None when it made none (the proxy's setting decides)."""
    for event in reversed(events):
        if event.kind == EventKind.TOKEN_IN:
            choice = event.body.get("token_in")
            if isinstance(choice, bool):
                return choice
    return None


@dataclass(frozen=True, slots=True)
class RolloutEvent:
    """An event as the store holds it: placed at `position`, chained to the one before."""

    rollout_id: str
    position: int
    kind: str
    seq: int | None
    call_id: str | None
    at_ms: int
    body: Mapping[str, Any]
    prev_hash: str
    hash: str


def event_hash(
    rollout_id: str,
    position: int,
    kind: str,
    seq: int | None,
    call_id: str | None,
    at_ms: int,
    body: Mapping[str, Any],
    prev_hash: str,
) -> str:
    """SHA-256 (hex) of the event's canonical encoding (docs/digest.md)."""
    values = (rollout_id, position, str(kind), seq, call_id, at_ms, dict(body), prev_hash)
    h = hashlib.sha256(EVENT_DOMAIN)
    for name, value in zip(EVENT_FIELDS, values, strict=True):
        h.update(encode_value(name))
        h.update(encode_value(value, field=f"event.{name}"))
    return h.hexdigest()


def chain_event(draft: EventDraft, head: tuple[int, str] | None) -> RolloutEvent:
    """`draft` placed after `head`, the rollout's last event as (position, hash); None when the
    rollout has no event yet."""
    position = 0 if head is None else head[0] + 1
    prev = "" if head is None else head[1]
    body = dict(draft.body)
    digest = event_hash(
        draft.rollout_id, position, draft.kind, draft.seq, draft.call_id, draft.at_ms, body, prev
    )
    return RolloutEvent(
        draft.rollout_id,
        position,
        str(draft.kind),
        draft.seq,
        draft.call_id,
        draft.at_ms,
        body,
        prev,
        digest,
    )


def chain_head(events: Sequence[RolloutEvent]) -> str | None:
    """A rollout's chain head: the hash of its last event, which covers every event before it
    (each names the one before) and, through the ``staged`` events, every record's digest; None
    for a rollout without events. The control API's seal and outcome answers carry it
    (``chain_head``); a driver keeps it, and anchored reads refuse a rollout whose stored chain
    does not end there (docs/contract.md, "Anchored reads")."""
    return events[-1].hash if events else None


@dataclass(frozen=True, slots=True)
class ChainBreak:
    """Where a rollout's chain does not hold: the position and what is wrong there."""

    position: int
    message: str


def check_chain(events: Sequence[RolloutEvent]) -> list[ChainBreak]:
    """Every break in one rollout's events (given in position order); [] when the chain holds.

    Finds a deleted event (a gap in the positions, or the next event's `prev_hash` naming
    another hash) and an edited one (its hash no longer matches its content). Deleting the
    *last* events of a chain leaves a shorter chain that holds: the claims they accounted for
    then read as ``lost_in_crash`` instead.
    """
    breaks: list[ChainBreak] = []
    prev: RolloutEvent | None = None
    for event in events:
        want_pos = 0 if prev is None else prev.position + 1
        want_prev = "" if prev is None else prev.hash
        if event.position != want_pos:
            breaks.append(
                ChainBreak(
                    want_pos,
                    f"event {want_pos} is missing (the next stored event is at "
                    f"position {event.position})",
                )
            )
        elif event.prev_hash != want_prev:
            breaks.append(
                ChainBreak(
                    event.position, "its previous-event hash does not match the event before"
                )
            )
        try:
            recomputed = event_hash(
                event.rollout_id,
                event.position,
                event.kind,
                event.seq,
                event.call_id,
                event.at_ms,
                event.body,
                event.prev_hash,
            )
        except ValueError as e:  # an EncodingError: a body no writer could have hashed
            breaks.append(ChainBreak(event.position, f"cannot be hashed: {e}"))
        else:
            if recomputed != event.hash:
                breaks.append(ChainBreak(event.position, "edited: its hash does not match"))
        prev = event
    return breaks
