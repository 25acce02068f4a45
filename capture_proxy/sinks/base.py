"""The staging protocols: records go into a store (`StagingSink`) and back out (`StagingSource`).

A sink is what the proxy writes every call through. Its promise is all-or-nothing: when `stage`
returns a `StageResult` with status ``staged``, the record *and every attachment passed with it*
are durable (a crash after that moment loses neither); when it returns ``capture_failed`` or
raises, nothing of the call is visible, now or after a crash. There is no third outcome, and a sink
never drops attachments to make a write succeed.

Sinks also keep each rollout's ledger: its state (open/sealed) and every call that was *not*
staged, with its status and reason, so a rollout cut short stays visible after a restart.

And each rollout's event log (`capture_proxy.schemas.events`): an append-only, hash-chained list
of admission claims (one per seq, refused when the seq is taken), ``staged`` events (appended by
`stage` with the record), ``ledger`` events (appended by `record_failure` with the entry) and
seals. The store places each event in its rollout's chain (position and previous hash) inside
the same atomic write as what it records, so the chain is always exactly what is durable.

Write your own sink by implementing `StagingSink` (and `StagingSource`, to read it back), register
it in ``tests/support/sink_factories.py`` and make ``tests/sinks/test_sink_conformance.py`` pass.
`MemorySink` is the reference implementation and the test double.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import CaptureProxyError
from ..schemas.events import EventDraft, RolloutEvent
from ..schemas.records import (
    Attachment,
    CallSummary,
    CommitCoords,
    LedgerEntry,
    RolloutInfo,
    StagedCallRecord,
    StageResult,
)
from ..schemas.store_head import ClaimCount

__all__ = [
    "PROXY_STATE_ROLLOUT",
    "ClaimFiles",
    "CompactStats",
    "DuplicateSeq",
    "FaultHook",
    "GcStats",
    "Progress",
    "ReadsRolloutsAhead",
    "SinkWithSource",
    "StagingSink",
    "StagingSource",
    "StoreDamaged",
    "StoreError",
    "StoreFormatError",
    "UnsupportedStoreOperation",
]

#: The id of the rollout header that holds the proxy's own state (today: the driver's weight
#: version, in its metadata), written with `StagingSink.put_rollout` like any rollout header, so
#: every store kind keeps it without a table or file of its own. Sources leave it out of
#: `StagingSource.rollouts()`. The ``/`` keeps it apart from every rollout a client can name
#: (rollout ids are ``[A-Za-z0-9._:-]``).
PROXY_STATE_ROLLOUT = "capture-proxy/state"

#: Test hook: sinks call it with a point name (``"after_record"``, ``"after_attachments"``)
#: inside their write; raising there must leave nothing of the call behind.
FaultHook = Callable[[str], None]

#: Told how far a long store operation (gc, compaction, verification) is: ``progress(done,
#: total)`` in the operation's own steps, called as each step ends (`capture-proxy` draws a bar
#: with it on a terminal). Operations take it as ``progress=None``: nobody is told.
Progress = Callable[[int, int], None]


class StoreError(CaptureProxyError):
    """A store cannot be opened or used (bad URL, missing file, unwritable)."""


class StoreDamaged(StoreError, CaptureProxyError, ValueError):
    """A store holds something no writer of it could have written: a value of the wrong type
    (a text ``seq``), bytes that do not decode, a blob that decompresses past its limit. The
    read cannot go on; nothing is guessed. ``capture-proxy inspect --verify`` lists each such
    place (a store file may come from someone else). A `ValueError` too, as damage read from a
    store was before it had a class of its own."""


class StoreFormatError(StoreError):
    """A store was written by a format this version does not know (usually: a newer release)."""


class DuplicateSeq(StoreError):
    """The store already holds another call at this ``(rollout, seq)``; nothing was written.

    A store holds one call per sequence number of a rollout: its admission claim, its staged
    record or its ledger entry (one call may have all three). `stage` refuses a second one as
    ``capture_failed`` with reason ``duplicate_seq``; `record_failure` and a claim
    (`StagingSink.append_event`) raise this.
    """

    def __init__(self, rollout_id: str, seq: int, holder: str) -> None:
        super().__init__(f"rollout {rollout_id} already holds seq {seq} (call {holder})")
        self.rollout_id = rollout_id
        self.seq = seq
        self.holder = holder


class UnsupportedStoreOperation(StoreError):
    """The store's kind has no such operation (gc of an in-process store, compaction of SQLite).

    A usage error: nothing was read or changed.
    """


@dataclass(frozen=True, slots=True)
class GcStats:
    """What a retention pass (`capture-proxy gc`) removed, or with ``dry_run`` would remove."""

    #: The sealed rollouts removed, oldest seal first.
    rollouts: list[str]
    #: Their staged calls, orphaned ones included.
    calls: int
    #: Message and request blobs no remaining call refers to.
    blobs: int
    #: Attachments (image bytes) no remaining call refers to.
    attachments: int
    #: The store's size before and after: the file (SQLite) or the live units (Parquet).
    bytes_before: int
    bytes_after: int
    #: Seconds the run held the store's maintenance lease (Parquet; 0 for a dry run, which
    #: commits nothing and does not take it).
    lease_held_s: float = 0.0


@dataclass(frozen=True, slots=True)
class CompactStats:
    """What a compaction (`capture-proxy compact`) did. `*_before` / `*_after` count the live
    units (groups of files committed together) and their files."""

    units_before: int
    units_after: int
    files_before: int
    files_after: int
    bytes_before: int
    bytes_after: int
    #: Staged calls in the store (unchanged by compaction).
    records: int
    #: Files deleted: units retired more than `grace_s` ago, and crashed commits' leftovers.
    deleted_files: int
    #: Seconds the run held the store's maintenance lease (Parquet: it merges before taking
    #: it, and holds it only to check and commit).
    lease_held_s: float = 0.0
    #: Merges written and not committed, because another maintenance run merged some of
    #: their units first (their files are deleted; the next run merges what is left).
    merges_dropped: int = 0


@runtime_checkable
class StagingSink(Protocol):
    """Where the proxy stages records. Implementations must be safe for concurrent `stage` calls
    from one event loop, and must not block it (do I/O on a thread or with async I/O).
    """

    #: The store's URL, reported in `CommitCoords.store`.
    url: str

    async def stage(
        self, record: StagedCallRecord, *, attachments: Mapping[str, Attachment] | None = None
    ) -> StageResult:
        """Durably write `record` (already sealed: digests filled) with its attachments.

        `attachments` maps sha256 to `Attachment`. The caller passes the keyword only when the
        call had attachments to store, so a text-only sink that does not accept it keeps
        working for text-only calls (and fails loudly, with TypeError, for calls with images).

        Storage is linear in a session: when `record.parent_call_id` names a staged call, the sink
        stores only the tokens after the longest common prefix of the parent's prompt + completion
        and this call's prompt + completion, and reports that prefix as `prev_len`.

        Returns ``StageResult.staged(coords)`` once durable, ``StageResult.failed(...)`` for a
        record it refuses (a duplicate staging key; ``duplicate_seq`` when another call of the
        rollout already holds the record's seq, see `DuplicateSeq`), and raises for I/O failures;
        in every case but the first, nothing of the call was written. A staged record comes
        with a ``staged`` event in its rollout's chain (`schemas.events.staged_event`), written
        in the same atomic step.
        """
        ...

    async def record_failure(self, entry: LedgerEntry) -> None:
        """Add a not-staged call to its rollout's ledger (creating the rollout if new).

        Raises `DuplicateSeq` when another call of the rollout already holds the entry's seq.
        Appends a ``ledger`` event (`schemas.events.ledger_event`) in the same atomic write.
        """
        ...

    async def append_event(self, event: EventDraft) -> RolloutEvent:
        """Append `event` to its rollout's chain; returns it as stored (position, hashes).

        A ``claim`` (`schemas.events.claim_event`) is refused with `DuplicateSeq`, nothing
        written, when another call already holds its seq: claimed, staged or in the ledger.
        Durable when this returns, like `stage`; raises `StoreError` for I/O failures. (A
        Parquet dataset's claim is durable as its claim file, which holds the seq; its event
        commits with the next unit written: docs/storage.md.)
        """
        ...

    async def put_rollout(self, info: RolloutInfo) -> None:
        """Create or update a rollout's ledger header (state, metadata, policy)."""
        ...

    async def mark_orphaned(self, call_id: str, reason: str) -> None:
        """Flag a staged record whose write landed after its caller gave up (stage timeout).

        Readers keep such records out of `calls()` and trajectories unless asked for them.
        """
        ...

    async def close(self) -> None:
        """Finish pending writes and release the store."""
        ...


@runtime_checkable
class StagingSource(Protocol):
    """Reads a store back. Synchronous: trainers and `inspect` read without an event loop."""

    url: str

    def rollouts(self) -> list[str]:
        """Rollout ids, oldest first (without `PROXY_STATE_ROLLOUT`)."""
        ...

    def rollout_info(self, rollout_id: str) -> RolloutInfo:
        """The rollout's ledger header; raises KeyError for an unknown rollout."""
        ...

    def calls(self, rollout_id: str, *, include_orphaned: bool = False) -> list[StagedCallRecord]:
        """The rollout's staged records in sequence order, attachments included."""
        ...

    def failures(self, rollout_id: str) -> list[LedgerEntry]:
        """The rollout's not-staged calls, in sequence order."""
        ...

    def events(self, rollout_id: str) -> list[RolloutEvent]:
        """The rollout's event log in position order, as stored ([] for a store or rollout
        written before event logs: nothing to check). Not checked here: `Store.verify` does."""
        ...

    def claims(self, rollout_id: str) -> dict[int, str]:
        """The rollout's admission claims: seq -> the call id holding it ({} when none)."""
        ...

    def summaries(self, rollout_id: str) -> list[CallSummary]:
        """One `CallSummary` per staged record of the rollout, orphaned ones included (flagged),
        in sequence order; [] for an unknown rollout.

        Reads only scalar columns (lengths, lineage, times): no token ids, messages or
        attachments are decoded or checked, so it is cheap enough for listings of a whole store.
        Use `calls` or `fetch` when the content matters.
        """
        ...

    def fetch(self, keys: Sequence[str]) -> list[StagedCallRecord]:
        """Exactly one record per staging key, in order; KeyError names a missing key."""
        ...

    def coords(self, keys: Sequence[str]) -> list[CommitCoords]:
        """The commit coordinates of staged records, in order; KeyError for a missing key."""
        ...

    def orphaned(self) -> set[str]:
        """Staging keys of records marked orphaned."""
        ...

    def all_keys(self) -> Iterable[str]:
        """Every staging key in the store (for `verify`)."""
        ...

    def unreferenced_attachments(self) -> list[str]:
        """sha256 of stored attachments no record refers to (a torn write would leave these)."""
        ...

    def close_reader(self) -> None:
        """Release what the reader holds (connections, file handles)."""
        ...


@runtime_checkable
class ClaimFiles(Protocol):
    """A source whose admission claims are files of their own (a Parquet dataset), which the
    store head covers (docs/digest.md, "The store head"). Other stores hold their claims as
    events only."""

    def claim_counts(self) -> Mapping[str, ClaimCount]:
        """Every rollout's claim files: how many, and the highest seq (rollout id -> count)."""
        ...


@runtime_checkable
class SinkWithSource(Protocol):
    """A sink that keeps a reader on its own store and lends it (`ParquetSink`).

    The proxy reads through the lent reader (resume, manifests, the read routes) instead of
    opening a second one on the same store, so it holds one index of the store, not two. The
    reader is the sink's: it is thread-safe, sees the sink's commits, and is released by the
    sink's `close` (not by its borrowers).
    """

    def own_source(self) -> StagingSource:
        """The sink's reader on its store (the same object every time)."""
        ...


@runtime_checkable
class ReadsInSnapshots(Protocol):
    """A source whose reads can share one listing of its store (`ParquetSource`: on object
    storage a listing is a request per thousand units, and a read that asks for one of its own
    waits for the reader's refresh under way). What reads one rollout (a resume) reads it
    inside ``with source.snapshot():``."""

    def snapshot(self, max_age_s: float = 0.0) -> AbstractContextManager[None]:
        """Reads on this thread inside the block share the listing taken as it starts."""
        ...


@runtime_checkable
class ReadsRolloutsAhead(Protocol):
    """A sink that reads a rollout it does not hold before writing it (`ParquetSink` on object
    storage, where other proxies may have continued the rollout): the proxy has the read made as
    it resumes the rollout, within ``--rollout-resume-timeout``, so the rollout's writes do not
    wait for it (a slow read is then the resume's 503, not a staging timeout)."""

    async def prepare_rollout(self, rollout_id: str) -> None:
        """Read what the sink's next write of `rollout_id` needs from the store now."""
        ...
