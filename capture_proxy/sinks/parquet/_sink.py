"""`ParquetSink`: stage records into a Parquet dataset folder (a local folder or object storage).

The dataset is a folder of immutable Parquet files grouped into *units* (`_layout`
describes the files). Concurrent `stage` calls are group-committed: everything queued while the
previous unit was being written becomes the next unit, written by one thread
(`_writer.UnitWriter`) as data files under temporary names, fsynced and renamed, then a
commit marker, the same way. `stage` returns only once the marker naming its record is durable.
A crash at any moment leaves either the whole unit or no unit: files without a marker are not
part of the dataset.

Within a unit each record is its own all-or-nothing piece: a record that is refused (duplicate
key, a seq another call of its rollout holds, missing attachment) or whose write raises (for
example the ``fault`` hook at ``"after_record"`` / ``"after_attachments"``) leaves no row, and its
`stage` returns or raises that; **the other records of the batch still commit**. If writing the
unit itself fails, every record in it gets a `StoreError` and nothing of the batch is visible.

Attachments go into the same unit as the record that first refers to them, content-addressed:
each sha256 is stored once per dataset. Storage is linear in a session, with the encoding the
SQLite sink uses (`codec.encode_record`): a call stores only the tokens after its parent's, and
each message once. The rollout ledger is in the dataset too (``ledger/`` files).

One writing proxy per dataset (one `ParquetSink`) at a time, on a local folder and on object
storage alike: it keeps what it checks new calls against in memory, so a second writer would not
see the first one's. On a local folder a lock file enforces it (a second sink is refused with
`StoreError`); on object storage nothing enforces it yet (no lock, and claims are checked, not
enforced: the sink warns at open), so a deployment gives each proxy its own dataset
(docs/storage.md, "Writers and readers today"). Readers (`ParquetSource`, Arrow engines) may be
any number, anywhere, beside the writer, and so may compaction and gc
(`capture_proxy.sinks.parquet.compact_store`, `gc_parquet`; one at a time, through a lease).

What it keeps is bounded by live work, not by the size of the store: the call ids and the
(rollout, seq) holders of the rollouts in use (the `max_live_rollouts` most recently used, a
sealed rollout dropped once its seal commits; a rollout that comes back is read from its units
by the writer's own reader), the most recent `max_blob_keys` blob keys (a blob not among them is
stored again: a few bytes more, never a wrong record; readers and compaction keep one copy), and
per rollout its id and per attachment its sha256 (each exactly: a header must not be written
twice, and a record may refer to an attachment an earlier call stored). A staging key is refused
as a duplicate within its rollout (the proxy's call ids are unique by construction).

Blobs and attachments are shared only with copies committed less than `dedup_window_s` ago
(`_layout.DEDUP_WINDOW_S`, an hour): an older one is stored again, and a reference alone to an
older attachment is refused as ``missing_attachment``. That is what lets gc run while the
proxy writes: it removes only copies older than the window (`_gc`).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from ...schemas.events import EventDraft, EventKind, RolloutEvent, ledger_event, staged_event
from ...schemas.records import (
    Attachment,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
    StageResult,
)
from ..base import DuplicateSeq, FaultHook, StoreError
from ..codec import encode_record
from ..staging_rules import coords_for, new_attachments
from ._claims import create_claim
from ._events import EventHeads
from ._fs import DatasetFS
from ._index import LRU
from ._layout import (
    ATTACHMENTS,
    BLOBS,
    CALLS,
    DEDUP_WINDOW_S,
    LEDGER,
    WRITER_LOCK,
    check_format,
    create_dataset,
)
from ._ledger import failure_row, orphan_row, rollout_row
from ._source import ParquetSource, default_url
from ._writer import UnitRows, UnitWriter

__all__ = ["ParquetSink", "ParquetSource"]

log = logging.getLogger(__name__)


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(slots=True)
class _RolloutKeys:
    """A rollout's committed call ids, and which call holds each seq."""

    calls: set[str] = field(default_factory=set)
    seqs: dict[int, str] = field(default_factory=dict)


class _RecentKeys:
    """The `limit` keys added or looked up most recently, each for `window_ns` after it was
    added (the window rule: gc may remove older copies)."""

    def __init__(self, limit: int, window_ns: int) -> None:
        self.limit = max(1, limit)
        self.window_ns = window_ns
        self._keys: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        added = self._keys.get(key)
        if added is None or time.time_ns() - added >= self.window_ns:
            return False
        self._keys.move_to_end(key)
        return True

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str) -> None:
        self._keys[key] = time.time_ns()
        self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)


class ParquetSink:
    """A `StagingSink` writing the Parquet dataset at `location` (created when missing).

    `location` is a folder path or a pyarrow filesystem URL; `url` is what coordinates report
    (default ``parquet:///<location>``). Construct it once at startup: the constructor checks the
    format (raising `StoreError` / `StoreFormatError`), creates the dataset if needed, reads the
    keys already staged and starts the writer thread. `max_batch` caps how many queued writes
    share one unit; `cache_tokens` bounds the cache of recent full sequences that children are
    stored against. `max_live_rollouts` and `max_blob_keys` bound what the writer keeps to
    refuse duplicates and share blobs (see the module docstring); `dedup_window_s` is how long
    a committed blob or attachment is shared (gc relies on the default: lower only). `filesystem`
    is a configured pyarrow filesystem that `location` is a path in (object storage with
    credentials, say).
    `close` commits everything queued; `stage` after `close` raises RuntimeError.
    """

    def __init__(
        self,
        location: str,
        *,
        url: str | None = None,
        fault: FaultHook | None = None,
        max_batch: int = 256,
        cache_tokens: int = 4_000_000,
        max_live_rollouts: int = 4096,
        # About 0.2 KB each: 3.4 MB. A session's own history and the prompts every session
        # shares are looked up all the time, so they stay; what falls out is rarely sent again.
        max_blob_keys: int = 16_384,
        filesystem: pafs.FileSystem | None = None,
        dedup_window_s: float = DEDUP_WINDOW_S,
    ) -> None:
        self.location = location
        self.url = url or default_url(location)
        self.fault = fault
        self.dedup_hits = 0
        dfs = DatasetFS(location, filesystem)
        if not check_format(dfs):
            create_dataset(dfs)
        try:
            self._lock = dfs.lock(WRITER_LOCK)
        except BlockingIOError as exc:
            raise StoreError(
                f"another ParquetSink is writing {dfs.root}: a dataset has one writer at a time"
            ) from exc
        try:
            # Rebuilds parents' sequences on a cache miss and the keys of a rollout that comes
            # back; only the writer thread uses it. Indexed per unit: it lives as long as this.
            self._reader = ParquetSource(location, url=self.url, dfs=dfs, index="units")
            known = self._reader.known()
            self._events = EventHeads(self._reader.event_heads(), self._stored_head)
        except BaseException:
            self._lock.release()
            raise
        self._live: OrderedDict[str, _RolloutKeys] = OrderedDict()
        self.max_live_rollouts = max(1, max_live_rollouts)
        self._window_ns = int(dedup_window_s * 1e9)
        self._blobs = _RecentKeys(max_blob_keys, self._window_ns)
        self._attachments = known.attachments  # sha256 -> when its copy we share was committed
        self._rollouts = known.rollouts
        self._fulls: LRU[str, tuple[str, array[int]]] = LRU(cache_tokens, lambda v: len(v[1]))
        if not dfs.local:
            log.warning(
                "%s: admission claims are checked but not enforced on object storage yet: two "
                "writers racing for one seq can both claim it (docs/storage.md)",
                location,
            )
        self._dfs = dfs
        self._writer = UnitWriter(
            dfs,
            name=location,
            max_batch=max_batch,
            last_order=known.last_order,
            publish=self._publish,
        )

    # -- StagingSink ----------------------------------------------------------------------------

    async def stage(
        self, record: StagedCallRecord, *, attachments: Mapping[str, Attachment] | None = None
    ) -> StageResult:
        if not record.digest or not record.extras_digest:
            raise ValueError(f"{record.staging_key}: stage a sealed record (seal_record) only")
        given = dict(attachments or {})
        result: StageResult = await self._writer.submit(
            lambda batch, part: self._stage_one(batch, part, record, given)
        )
        return result

    async def record_failure(self, entry: LedgerEntry) -> None:
        def work(batch: UnitRows, part: UnitRows) -> None:
            holder = self._seq_holder(batch, entry.rollout_id, entry.seq, entry.call_id)
            if holder is not None:
                raise DuplicateSeq(entry.rollout_id, entry.seq, holder)
            self._ensure_rollout(batch, part, entry.rollout_id)
            part.rows[LEDGER].append(failure_row(entry))
            part.seqs[(entry.rollout_id, entry.seq)] = entry.call_id
            self._events.place(batch, part, ledger_event(entry))

        await self._writer.submit(work)

    async def append_event(self, event: EventDraft) -> RolloutEvent:
        """Append `event` to its rollout's chain in the next unit; see
        `StagingSink.append_event`. A claim also creates its claim file first (`_claims`:
        exclusive and fsynced on a local folder, checked only on object storage)."""

        def work(batch: UnitRows, part: UnitRows) -> RolloutEvent:
            if event.kind is EventKind.CLAIM:
                assert event.seq is not None
                assert event.call_id is not None
                holder = self._seq_holder(batch, event.rollout_id, event.seq, event.call_id)
                if holder is not None:
                    raise DuplicateSeq(event.rollout_id, event.seq, holder)
                holder = create_claim(
                    self._dfs, event.rollout_id, event.seq, event.call_id, event.at_ms
                )
                if holder is not None:
                    raise DuplicateSeq(event.rollout_id, event.seq, holder)
                part.seqs[(event.rollout_id, event.seq)] = event.call_id
                self._ensure_rollout(batch, part, event.rollout_id)
            return self._events.place(batch, part, event)

        stored: RolloutEvent = await self._writer.submit(work)
        return stored

    async def put_rollout(self, info: RolloutInfo) -> None:
        def work(batch: UnitRows, part: UnitRows) -> None:
            part.rows[LEDGER].append(rollout_row(info))
            part.rollouts.add(info.rollout_id)
            if info.state is RolloutState.SEALED:
                part.sealed.add(info.rollout_id)

        await self._writer.submit(work)

    async def mark_orphaned(self, call_id: str, reason: str) -> None:
        def work(batch: UnitRows, part: UnitRows) -> None:
            staged = batch.calls.get(call_id)
            rollout_id = staged[0] if staged else self._rollout_of(call_id)
            part.rows[LEDGER].append(orphan_row(call_id, rollout_id, reason, _now_ms()))

        await self._writer.submit(work)

    def stats(self) -> dict[str, float]:
        """Writer figures for /metrics (names without the ``capture_proxy_sink_`` prefix)."""
        return {**self._writer.stats(), "attachment_dedup_hits_total": self.dedup_hits}

    async def close(self) -> None:
        """Commit every queued write and stop the writer thread."""
        await self._writer.close()
        self._reader.close_reader()
        self._fulls.clear()
        self._lock.release()

    # -- the writer thread ----------------------------------------------------------------------

    def _publish(self, batch: UnitRows) -> None:
        # Only committed units reach these: a record whose unit failed must not be a parent.
        for call_id, (rollout_id, full) in batch.calls.items():
            self._fulls.put(call_id, (rollout_id, full))
            keys = self._live.get(rollout_id)
            if keys is not None:  # else it left memory: the reader finds the call if it returns
                keys.calls.add(call_id)
        for blob_key in batch.blobs:
            self._blobs.add(blob_key)
        committed = time.time_ns()
        for sha in batch.attachments:
            self._attachments[sha] = committed
        self._rollouts |= batch.rollouts
        self._events.publish(batch)
        for (rollout_id, seq), call_id in batch.seqs.items():
            keys = self._live.get(rollout_id)
            if keys is not None:
                keys.seqs.setdefault(seq, call_id)
        for rollout_id in batch.sealed:
            # A sealed rollout takes no more calls; a late ledger entry reads it back.
            self._live.pop(rollout_id, None)

    def _stored_head(self, rollout_id: str) -> tuple[int, str] | None:
        """The last committed event of a rollout whose head was dropped (sealed)."""
        if rollout_id not in self._rollouts:
            return None  # new: no event of it is stored
        events = self._reader.events(rollout_id)
        return (events[-1].position, events[-1].hash) if events else None

    def _keys(self, rollout_id: str) -> _RolloutKeys:
        """What is committed of `rollout_id` (read from the dataset when not in memory)."""
        keys = self._live.get(rollout_id)
        if keys is not None:
            self._live.move_to_end(rollout_id)
            return keys
        if rollout_id in self._rollouts:
            calls, seqs = self._reader.rollout_keys(rollout_id)
            keys = _RolloutKeys(calls, seqs)
        else:
            keys = _RolloutKeys()  # new: nothing of it is stored
        self._live[rollout_id] = keys
        while len(self._live) > self.max_live_rollouts:
            self._live.popitem(last=False)
        return keys

    def _rollout_of(self, call_id: str) -> str | None:
        """The rollout of a call the writer holds in memory (None: not known here; an orphan
        mark then names no rollout, and readers find it through the call)."""
        for rollout_id, keys in reversed(self._live.items()):
            if call_id in keys.calls:
                return rollout_id
        return None

    def _seq_holder(self, batch: UnitRows, rollout_id: str, seq: int, call_id: str) -> str | None:
        """Another call already at (rollout_id, seq): committed, or earlier in this batch."""
        holder = batch.seqs.get((rollout_id, seq)) or self._keys(rollout_id).seqs.get(seq)
        return holder if holder is not None and holder != call_id else None

    def _shared(self, batch: UnitRows, sha: str) -> bool:
        """Whether a record may refer to the stored copy of attachment `sha` (the window rule)."""
        if sha in batch.attachments:
            return True
        committed = self._attachments.get(sha)
        return committed is not None and time.time_ns() - committed < self._window_ns

    def _ensure_rollout(self, batch: UnitRows, part: UnitRows, rollout_id: str) -> None:
        if rollout_id in self._rollouts or rollout_id in batch.rollouts:
            return
        part.rows[LEDGER].append(
            rollout_row(RolloutInfo(rollout_id, RolloutState.OPEN, False, _now_ms()))
        )
        part.rollouts.add(rollout_id)

    def _parent_full(self, batch: UnitRows, record: StagedCallRecord) -> array[int] | None:
        parent = record.parent_call_id
        if parent is None:
            return None
        hit = batch.calls.get(parent) or self._fulls.get(parent)
        if hit is None:
            if parent not in self._keys(record.rollout_id).calls:
                return None  # not staged here, or another rollout's: store the call whole
            try:
                hit = self._fulls.put(parent, (record.rollout_id, self._reader.full(parent)))
            except (KeyError, ValueError, OSError) as e:
                # Storing this call whole keeps it exact; `verify` reports the damaged ancestor.
                log.warning("%s: storing whole, parent unreadable: %s", record.call_id, e)
                return None
        rollout_id, full = hit
        return full if rollout_id == record.rollout_id else None

    def _stage_one(
        self,
        batch: UnitRows,
        part: UnitRows,
        record: StagedCallRecord,
        given: dict[str, Attachment],
    ) -> StageResult:
        key = record.staging_key
        if key in batch.calls or key in self._keys(record.rollout_id).calls:
            return StageResult.failed("duplicate_key", f"staging key {key} is already staged")
        holder = self._seq_holder(batch, record.rollout_id, record.seq, key)
        if holder is not None:
            return StageResult.failed(
                "duplicate_seq", str(DuplicateSeq(record.rollout_id, record.seq, holder))
            )
        checked = new_attachments(record, given, lambda sha: self._shared(batch, sha))
        if isinstance(checked, StageResult):
            return checked
        new, hits = checked
        self.dedup_hits += hits
        encoded = encode_record(record, self._parent_full(batch, record), given)
        part.rows[CALLS].append(encoded.row)
        part.calls[key] = (record.rollout_id, encoded.full)
        part.seqs[(record.rollout_id, record.seq)] = key
        for blob_key, data in encoded.blobs.items():
            if blob_key not in self._blobs and blob_key not in batch.blobs:
                part.rows[BLOBS].append({"key": blob_key, "data": data})
                part.blobs.add(blob_key)
        if self.fault is not None:
            self.fault("after_record")
        for att in new:
            part.rows[ATTACHMENTS].append(
                {
                    "sha256": att.sha256,
                    "media_type": att.media_type,
                    "size": att.size,
                    "data": att.data,
                }
            )
            part.attachments.add(att.sha256)
        if self.fault is not None:
            self.fault("after_attachments")
        self._ensure_rollout(batch, part, record.rollout_id)
        self._events.place(batch, part, staged_event(record, _now_ms()))
        row = encoded.row
        return StageResult.staged(coords_for(self.url, record, row))
