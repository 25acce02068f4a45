"""The rollout index: rollout ids by state, seal time, group and grading, without reading records.

A trainer asking for "the sealed, graded rollouts of group g" or "what was sealed since t" must
not pay for the whole store. Each store kind answers `RolloutQuery` from what it keeps per rollout
(the SQLite file: columns and indexes of its ``rollouts`` table, format 7; a Parquet reader: a
directory of its ledger's headers, kept up to date as units are indexed; a proxy's store: the
same, evaluated on the proxy by ``GET /admin/store/rollouts?state=...``). A source without an
index of its own is scanned one header at a time (`scan_headers`): the same answer, at the cost
of the store.

The index is a first cut, not the final word: ``poisoned`` here is what the header and ledger say
(a capture failure, an orphaned record); a call lost in a crash is known only from the event log,
which `capture_proxy.read.status.rollout_status` reads. Readers that hand rollouts to a trainer
narrow with the index and then read each kept rollout's status and records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from ..schemas.records import RolloutInfo, RolloutState
from .base import StagingSource

__all__ = [
    "IndexedRollout",
    "RolloutIndexer",
    "RolloutQuery",
    "State",
    "indexed",
    "row_of",
    "scan_headers",
]

#: The states a query can ask for: ``poisoned`` is any rollout (open or sealed) flagged poisoned;
#: ``open`` and ``sealed`` leave poisoned rollouts out.
State = Literal["open", "sealed", "poisoned"]


@dataclass(frozen=True, slots=True)
class IndexedRollout:
    """What the index keeps of one rollout."""

    rollout_id: str
    #: ``open`` or ``sealed`` (a rollout with calls and no header is open).
    state: str
    #: Flagged in its header or ledger (capture failure, orphaned record): see the module note.
    poisoned: bool
    created_at_ms: int
    sealed_at_ms: int | None
    #: The group of its latest outcome (None without one, or when the outcome names none).
    group_id: str | None
    #: An outcome was sent (``PUT /admin/rollouts/{id}/outcome``).
    graded: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "rollout_id": self.rollout_id,
            "state": self.state,
            "poisoned": self.poisoned,
            "created_at_ms": self.created_at_ms,
            "sealed_at_ms": self.sealed_at_ms,
            "group_id": self.group_id,
            "graded": self.graded,
        }


@dataclass(frozen=True, slots=True)
class RolloutQuery:
    """Which rollouts to list; every field left None keeps all.

    `since_ms` keeps sealed rollouts whose seal time (the writing proxy's clock) is at or after
    it; `groups` keeps rollouts whose latest outcome names one of them; `graded` keeps rollouts
    with (True) or without (False) an outcome. ``state="open"`` / ``"sealed"`` leave poisoned
    rollouts out unless `with_poisoned` (the batch API lists them, to say why it skips them).
    """

    state: State | None = None
    since_ms: int | None = None
    groups: frozenset[str] | None = None
    graded: bool | None = None
    with_poisoned: bool = False

    def __post_init__(self) -> None:
        if self.state not in (None, "open", "sealed", "poisoned"):
            raise ValueError(f"state must be open, sealed or poisoned, not {self.state!r}")

    def matches(self, row: IndexedRollout) -> bool:
        if self.state == "poisoned":
            if not row.poisoned:
                return False
        elif self.state is not None and (
            row.state != self.state or (row.poisoned and not self.with_poisoned)
        ):
            return False
        if self.since_ms is not None and (
            row.sealed_at_ms is None or row.sealed_at_ms < self.since_ms
        ):
            return False
        if self.groups is not None and row.group_id not in self.groups:
            return False
        return self.graded is None or row.graded == self.graded


@runtime_checkable
class RolloutIndexer(Protocol):
    """A `StagingSource` that keeps an index of its rollouts."""

    def indexed_rollouts(self, query: RolloutQuery) -> list[IndexedRollout]:
        """The rollouts `query` keeps, oldest first (the order of `StagingSource.rollouts`)."""
        ...


def row_of(info: RolloutInfo) -> IndexedRollout:
    """The index row of a rollout header (`info.poisoned` as the source computed it)."""
    outcome = info.outcome
    return IndexedRollout(
        info.rollout_id,
        "sealed" if info.state is RolloutState.SEALED else "open",
        info.poisoned,
        info.created_at_ms,
        info.sealed_at_ms,
        None if outcome is None else outcome.group_id,
        outcome is not None,
    )


def scan_headers(source: StagingSource, query: RolloutQuery) -> list[IndexedRollout]:
    """`query` answered by reading every rollout's header: for sources without an index."""
    out = []
    for rollout_id in source.rollouts():
        try:
            row = row_of(source.rollout_info(rollout_id))
        except KeyError:  # calls without a header (a store written before headers): open
            row = IndexedRollout(rollout_id, "open", False, 0, None, None, False)
        if query.matches(row):
            out.append(row)
    return out


def indexed(source: StagingSource, query: RolloutQuery) -> list[IndexedRollout]:
    """`query` through the source's own index when it has one, else `scan_headers`."""
    if isinstance(source, RolloutIndexer):
        return source.indexed_rollouts(query)
    return scan_headers(source, query)
