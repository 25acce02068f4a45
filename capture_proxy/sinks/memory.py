"""`MemorySink`: the reference sink, kept in memory. The test double for anything that stages.

It follows the protocol exactly (atomic record + attachments, duplicate keys refused, linear
lineage coordinates, a ledger), so a test that passes against it says something about the real
sinks too; `tests/sink_conformance.py` holds it to the same suite as SQLite and Parquet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from ..schemas.events import (
    EventDraft,
    EventKind,
    RolloutEvent,
    chain_event,
    ledger_event,
    staged_event,
)
from ..schemas.records import (
    Attachment,
    CallStatus,
    CallSummary,
    CommitCoords,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
    StageResult,
)
from ..schemas.tokens import common_prefix_len, full_sequence
from .base import PROXY_STATE_ROLLOUT, DuplicateSeq, FaultHook
from .codec import bind_media_types, reference_media_types

__all__ = ["MemorySink"]


class MemorySink:
    """An in-memory `StagingSink` and `StagingSource`.

    `fault` is called at ``"after_record"`` and ``"after_attachments"`` inside `stage`; if it
    raises, the call leaves no trace (as a failed transaction would). `delay` makes every write
    take that many seconds (to test stage timeouts and back-pressure).
    """

    def __init__(
        self, url: str = "memory://", *, fault: FaultHook | None = None, delay: float = 0.0
    ) -> None:
        self.url = url
        self.fault = fault
        self.delay = delay
        self._records: dict[str, StagedCallRecord] = {}
        self._coords: dict[str, CommitCoords] = {}
        self._attachments: dict[str, Attachment] = {}
        #: staging key -> the media type of each of its references (`reference_media_types`):
        #: the bytes are kept once, each record keeps the media types its digest binds.
        self._media_types: dict[str, list[str | None]] = {}
        self._rollouts: dict[str, RolloutInfo] = {}
        self._failures: dict[str, list[LedgerEntry]] = {}
        self._orphaned: dict[str, str] = {}
        #: rollout id -> seq -> the call holding it (claimed, staged or in the ledger)
        self._seqs: dict[str, dict[int, str]] = {}
        #: rollout id -> its event log, in position order
        self._events: dict[str, list[RolloutEvent]] = {}
        self._claims: dict[str, dict[int, str]] = {}
        self._lock = asyncio.Lock()
        self.closed = False

    # -- StagingSink -------------------------------------------------------------------------

    async def stage(
        self, record: StagedCallRecord, *, attachments: Mapping[str, Attachment] | None = None
    ) -> StageResult:
        if self.closed:
            raise RuntimeError("MemorySink is closed")
        if self.delay:
            await asyncio.sleep(self.delay)
        async with self._lock:
            key = record.staging_key
            if key in self._records:
                return StageResult.failed("duplicate_key", f"staging key {key} is already staged")
            holder = self._seq_holder(record.rollout_id, record.seq, key)
            if holder is not None:
                return StageResult.failed(
                    "duplicate_seq", str(DuplicateSeq(record.rollout_id, record.seq, holder))
                )
            for ref in record.attachment_refs():
                if ref not in (attachments or {}) and ref not in self._attachments:
                    return StageResult.failed(
                        "missing_attachment", f"the request refers to attachment {ref}, not given"
                    )
            prev_len = 0
            parent = self._records.get(record.parent_call_id or "")
            if parent is not None and parent.rollout_id == record.rollout_id:
                prev_len = common_prefix_len(
                    full_sequence(parent.prompt_token_ids, parent.completion_token_ids),
                    full_sequence(record.prompt_token_ids, record.completion_token_ids),
                )
            # Build everything first and publish in one step at the end: a fault at either hook
            # leaves the dicts untouched, like a rolled-back transaction.
            if self.fault:
                self.fault("after_record")
            refs = set(record.attachment_refs())
            # Only what the request refers to is kept, as the other sinks do: an attachment no
            # record refers to would read as a torn write.
            new_atts = {
                k: a
                for k, a in (attachments or {}).items()
                if k in refs and k not in self._attachments
            }
            if self.fault:
                self.fault("after_attachments")
            coords = CommitCoords(
                store=self.url,
                staging_key=key,
                digest=record.digest,
                extras_digest=record.extras_digest,
                prev_len=prev_len,
                delta_len=record.cum_len - prev_len,
                cum_len=record.cum_len,
                weight_version=record.weight_version,
            )
            self._attachments.update(new_atts)
            self._records[key] = replace(record, attachments=())
            self._media_types[key] = reference_media_types(record, attachments)
            self._coords[key] = coords
            self._seqs.setdefault(record.rollout_id, {}).setdefault(record.seq, key)
            self._ensure_rollout(record.rollout_id)
            self._append(staged_event(record, int(time.time() * 1000)))
            return StageResult.staged(coords)

    async def record_failure(self, entry: LedgerEntry) -> None:
        holder = self._seq_holder(entry.rollout_id, entry.seq, entry.call_id)
        if holder is not None:
            raise DuplicateSeq(entry.rollout_id, entry.seq, holder)
        self._ensure_rollout(entry.rollout_id)
        self._failures.setdefault(entry.rollout_id, []).append(entry)
        self._seqs.setdefault(entry.rollout_id, {}).setdefault(entry.seq, entry.call_id)
        self._append(ledger_event(entry))

    async def append_event(self, event: EventDraft) -> RolloutEvent:
        if self.closed:
            raise RuntimeError("MemorySink is closed")
        if self.delay:
            await asyncio.sleep(self.delay)
        async with self._lock:
            if event.kind is EventKind.CLAIM:
                assert event.seq is not None
                assert event.call_id is not None
                claimed = self._claims.get(event.rollout_id, {}).get(event.seq)
                holder = claimed or self._seq_holder(event.rollout_id, event.seq, event.call_id)
                if holder is not None:
                    raise DuplicateSeq(event.rollout_id, event.seq, holder)
                self._claims.setdefault(event.rollout_id, {})[event.seq] = event.call_id
                self._seqs.setdefault(event.rollout_id, {}).setdefault(event.seq, event.call_id)
                self._ensure_rollout(event.rollout_id)
            return self._append(event)

    def _append(self, draft: EventDraft) -> RolloutEvent:
        chain = self._events.setdefault(draft.rollout_id, [])
        event = chain_event(draft, (chain[-1].position, chain[-1].hash) if chain else None)
        chain.append(event)
        return event

    async def put_rollout(self, info: RolloutInfo) -> None:
        self._rollouts[info.rollout_id] = info

    async def mark_orphaned(self, call_id: str, reason: str) -> None:
        self._orphaned[call_id] = reason

    async def close(self) -> None:
        self.closed = True

    def _seq_holder(self, rollout_id: str, seq: int, call_id: str) -> str | None:
        holder = self._seqs.get(rollout_id, {}).get(seq)
        return holder if holder is not None and holder != call_id else None

    def _ensure_rollout(self, rollout_id: str) -> None:
        if rollout_id not in self._rollouts:
            self._rollouts[rollout_id] = RolloutInfo(
                rollout_id, RolloutState.OPEN, False, int(time.time() * 1000)
            )

    # -- StagingSource -----------------------------------------------------------------------

    def rollouts(self) -> list[str]:
        return [r for r in self._rollouts if r != PROXY_STATE_ROLLOUT]

    def rollout_info(self, rollout_id: str) -> RolloutInfo:
        info = self._rollouts[rollout_id]
        failed = any(
            f.status is CallStatus.CAPTURE_FAILED for f in self._failures.get(rollout_id, ())
        )
        orphaned = any(
            k in self._records and self._records[k].rollout_id == rollout_id for k in self._orphaned
        )
        poisoned = failed or orphaned
        return replace(info, poisoned=poisoned)

    def _with_attachments(self, record: StagedCallRecord) -> StagedCallRecord:
        shas = list(dict.fromkeys(record.attachment_refs()))
        atts = bind_media_types(
            [self._attachments[s] for s in shas], shas, self._media_types.get(record.staging_key)
        )
        return replace(record, attachments=atts)

    def calls(self, rollout_id: str, *, include_orphaned: bool = False) -> list[StagedCallRecord]:
        rs = [
            r
            for r in self._records.values()
            if r.rollout_id == rollout_id and (include_orphaned or r.call_id not in self._orphaned)
        ]
        return [self._with_attachments(r) for r in sorted(rs, key=lambda r: r.seq)]

    def failures(self, rollout_id: str) -> list[LedgerEntry]:
        return sorted(self._failures.get(rollout_id, ()), key=lambda f: f.seq)

    def events(self, rollout_id: str) -> list[RolloutEvent]:
        return list(self._events.get(rollout_id, ()))

    def claims(self, rollout_id: str) -> dict[int, str]:
        return dict(sorted(self._claims.get(rollout_id, {}).items()))

    def summaries(self, rollout_id: str) -> list[CallSummary]:
        rs = sorted(
            (r for r in self._records.values() if r.rollout_id == rollout_id), key=lambda r: r.seq
        )
        return [
            CallSummary(
                call_id=r.call_id,
                seq=r.seq,
                parent_call_id=r.parent_call_id,
                retry_of=r.retry_of,
                finish_reason=r.finish_reason,
                prompt_len=len(r.prompt_token_ids),
                completion_len=len(r.completion_token_ids),
                cum_len=r.cum_len,
                prev_len=self._coords[r.call_id].prev_len,
                created_at_ms=r.created_at_ms,
                weight_version=r.weight_version,
                orphaned=r.call_id in self._orphaned,
            )
            for r in rs
        ]

    def fetch(self, keys: Sequence[str]) -> list[StagedCallRecord]:
        out = []
        for k in keys:
            if k not in self._records:
                raise KeyError(k)
            out.append(self._with_attachments(self._records[k]))
        return out

    def coords(self, keys: Sequence[str]) -> list[CommitCoords]:
        return [self._coords[k] for k in keys]

    def orphaned(self) -> set[str]:
        return set(self._orphaned)

    def all_keys(self) -> Iterable[str]:
        return list(self._records)

    def unreferenced_attachments(self) -> list[str]:
        used = {s for r in self._records.values() for s in r.attachment_refs()}
        return sorted(set(self._attachments) - used)

    def close_reader(self) -> None:
        pass
