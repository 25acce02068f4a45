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
each sha256 is stored once per writer. Storage is linear in a session, with the encoding the
SQLite sink uses (`codec.encode_record`): a call stores only the tokens after its parent's, and
each message once. The rollout ledger is in the dataset too (``ledger/`` files).

**Which call holds a seq is the store's decision, not a writer's memory.** Every claim, staged
record and ledger entry holds its ``(rollout, seq)`` through a claim file created only if absent
(`_claims`): exclusive and fsynced on a local folder, a conditional ``PUT`` (``If-None-Match:
*``) on object storage. A group commit writes its claims at once, before its unit; a claim the
store refuses is `DuplicateSeq` (a record: ``duplicate_seq``), whoever holds the seq. A claim's
own event needs no unit: it commits with the next unit written (`_writer`), in the common case
with its call's record, so a call makes one unit, not two.

**Several writers.** On object storage any number of proxies (one `ParquetSink` each) may write one
dataset at once: units have names no other writer uses, claims decide seqs, and a copy of a blob or
attachment another writer also stored is harmless (readers keep one). A writer that touches a
rollout it does not hold in memory re-reads it from the store first (its highest claim, and when
another writer made it, the event chain's head; a thread keeps the writer's reader following the
dataset so that this finds little to index), so a rollout handed from one proxy to another
continues its chain and records a ``handoff`` event; a writer refused a seq by another writer's
claim drops what it held of that rollout. A local folder keeps one writer at a time (a lock file; a
second sink is refused with `StoreError`): several proxies on one host use object storage or a
folder each. On a configured pyarrow filesystem without an obstore store (`filesystem=` alone)
claims are checked, not enforced: one writer per dataset (the sink warns at open). Readers
(`ParquetSource`, Arrow engines) may be any number, anywhere, and see every writer's committed
units.

What it keeps is bounded by live work, not by the size of the store: the call ids of the
rollouts in use (the `max_live_rollouts` most recently used, a sealed rollout dropped once its
seal commits; a rollout that comes back is read from its units by the writer's own reader), the
holders of recently claimed seqs and the recent full sequences (`cache_tokens`), both dropped for
a rollout once its seal commits, the most recent `max_blob_keys` blob keys and
`max_attachment_keys` attachment sha256s, and per rollout a hash of its id (`RolloutIds`: about 9
bytes). A staging key is refused as a duplicate within its rollout (the proxy's call ids are
unique by construction).

Blobs and attachments are shared only with copies committed less than `dedup_window_s` ago (an
hour), which is what lets gc run while the proxy writes; `_shared` says how, and what a blob or
attachment the writer no longer remembers costs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from array import array
from collections.abc import Mapping
from typing import TYPE_CHECKING

import pyarrow as pa
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
from ...schemas.store_head import StoreHeadState
from ..base import DuplicateSeq, FaultHook, StoreError
from ..codec import encode_record
from ..staging_rules import coords_for
from ..store_head import StoreHeadKeeper
from ._claim_head import ClaimedHead
from ._claims import Holders, SeqClaim, claim_counts
from ._events import EventHeads
from ._fs import DatasetFS
from ._index import LRU
from ._keys import Claimed, RolloutIds, handoffs_in
from ._layout import (
    CALLS,
    DEDUP_WINDOW_S,
    LEDGER,
    PROBE_FILE,
    WRITER_LOCK,
    check_format,
    create_dataset,
)
from ._ledger import IMPLICIT, failure_row, orphan_row, rollout_row
from ._live import LiveRollouts
from ._resolve import ReadAhead, stored_chain
from ._shared import SharedCopies
from ._source import ParquetSource, default_url
from ._writer import UnitRows, UnitWriter, Work

if TYPE_CHECKING:
    from obstore.store import ObjectStore

__all__ = ["ParquetSink", "ParquetSource"]

#: How often the writer's reader picks up other writers' units on a shared dataset (seconds).
_FOLLOW_S = 5.0
#: The writer's reader's row-group cache (and a sixteenth of it in tokens of full sequences).
_READER_CACHE_BYTES = 8 << 20

log = logging.getLogger(__name__)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _system_allocator() -> None:
    """Make Arrow allocate from the C library's malloc, unless ``ARROW_DEFAULT_MEMORY_POOL``
    chose an allocator."""
    # pyarrow's wheels allocate through mimalloc, which keeps pages it freed and backs them with
    # transparent huge pages: a proxy writing Parquet grew about 4 MiB/min more with it than with
    # malloc, in steps of tens of MB its own allocations never reached (under 1 MiB at a time).
    # A writer lives as long as its proxy, so it makes the choice for the process.
    # docs/reports/reliability.md (section 6) has the measurements. The Parquet writer's encoders
    # take Arrow's C++ pool instead, set by that variable at import (`serve` sets it; 11th round).
    if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
        pa.set_memory_pool(pa.system_memory_pool())


class ParquetSink:
    """A `StagingSink` writing the Parquet dataset at `location` (created when missing).

    `location` is a folder path or a pyarrow filesystem URL; `url` is what coordinates report
    (default ``parquet:///<location>``). Construct it once at startup: the constructor checks the
    format (raising `StoreError` / `StoreFormatError`), creates the dataset if needed, reads the
    keys already staged and starts the writer thread. `max_batch` caps how many queued writes
    share one unit; `cache_tokens` bounds the cache of recent full sequences that children are
    stored against. `max_live_rollouts`, `max_blob_keys` and `max_attachment_keys` bound what
    the writer keeps to refuse duplicates and share blobs and attachments (see the module
    docstring); `dedup_window_s` is how long
    a committed blob or attachment is shared (gc relies on the default: lower only).
    `filesystem` is a configured pyarrow filesystem that `location` is a path in (object storage
    with credentials, say), read through it; `store` is an obstore store rooted at the same
    dataset that writes and claims go through. Without either, an object-storage URL
    (``s3://bucket/prefix``) is read with pyarrow and written with obstore, both configured from
    the standard environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ...). `writer_id` names this writer in its claims
    (default: host, process id and a random suffix). `linger_s`: after a unit, the next one is
    written no sooner than this many seconds after it, or than the last unit's commit took if
    that is shorter (`linger_capped`), with every write queued meanwhile (fewer units under
    load, each write waiting up to that long more; none after a quiet spell; 0, the default
    here, writes each batch at once; the proxy's ``--store-linger``). `close` commits
    everything queued; `stage` after `close` raises RuntimeError.

    Opening a sink makes pyarrow's calls allocate from the C library's ``malloc`` in the whole
    process (`pyarrow.system_memory_pool`), unless the ``ARROW_DEFAULT_MEMORY_POOL`` environment
    variable names an allocator: pyarrow's default, mimalloc, holds on to memory it freed, which
    a long-running proxy's resident memory would grow by. The Parquet writer's page buffers come
    from Arrow's C++ default pool, which only that variable set before pyarrow is imported
    chooses (``capture-proxy serve`` sets it to ``system``; a long-running program can too).
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
        # About 0.25 KB each: 2 MB. An agent resends its session's images with every call,
        # so a live session's stay.
        max_attachment_keys: int = 8_192,
        filesystem: pafs.FileSystem | None = None,
        dedup_window_s: float = DEDUP_WINDOW_S,
        store: ObjectStore | None = None,
        writer_id: str | None = None,
        linger_s: float = 0.0,
        linger_capped: bool = True,
    ) -> None:
        _system_allocator()
        self.location = location
        self.url = url or default_url(location)
        self.fault = fault
        self.writer_id = writer_id or f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        dfs = DatasetFS(location, filesystem, store)
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
            # back, and is lent to the proxy (`own_source`: resume, manifests, read routes), so
            # the process indexes the store once. Indexed per unit; a key per call only once a
            # read by key needs one (the writer finds a parent through its rollout). It lives as
            # long as this, so its caches are small (a resume reads a few rollouts' calls).
            self._reader = ParquetSource(
                location,
                url=self.url,
                dfs=dfs,
                index="units",
                call_keys="on_demand",
                cache_bytes=_READER_CACHE_BYTES,
                cache_tokens=_READER_CACHE_BYTES // 16,
            )
            # One listing of the commit markers for both (each read lists them otherwise: on
            # object storage a LIST request per thousand units, twice at every open).
            with self._reader.snapshot():
                known = self._reader.known()
                heads = self._reader.event_heads()
                unsealed = self._reader.unsealed_rollouts()
            # The chain heads of open rollouts only: a sealed one's is read from the store if
            # it takes another event (an outcome), and a store written for weeks has a
            # rollout sealed per few calls (about 0.2 KB each, held for the writer's life).
            self._events = EventHeads(
                heads if unsealed is None else {r: h for r, h in heads.items() if r in unsealed},
                self._stored_head,
            )
            # One writer at a time on a local folder (the lock): its head is the store's,
            # claim files included (`_claim_head`). On object storage several writers may
            # append to one rollout: none has the store's.
            self.store_head: StoreHeadKeeper | None = None
            self._claimed: ClaimedHead | None = None
            if dfs.local:
                state = StoreHeadState.of(
                    ((r, h, p) for r, (p, h) in heads.items()), claim_counts(dfs)
                )
                self.store_head = StoreHeadKeeper(location, state)
                self._claimed = ClaimedHead(dfs, self.store_head, self._events.committed)
        except BaseException:
            self._lock.release()
            raise
        self.max_live_rollouts = max(1, max_live_rollouts)
        self._shared = SharedCopies(
            self._reader,
            known.attachments,
            max_blob_keys=max_blob_keys,
            max_attachment_keys=max_attachment_keys,
            window_s=dedup_window_s,
        )
        self._rollouts = RolloutIds(known.rollouts)
        self._fulls: LRU[str, tuple[str, array[int]]] = LRU(cache_tokens, lambda v: len(v[1]))
        # Rollouts (and parents) it does not hold are read before their work is queued.
        self._ahead = ReadAhead(
            dfs,
            self._reader,
            lambda rollout_id: rollout_id in self._live,
            self._rollouts,
            self._fulls,
            self.max_live_rollouts,
        )
        if not dfs.enforced:
            log.warning(
                "%s: admission claims are checked but not enforced through a pyarrow "
                "filesystem: two writers racing for one seq can both claim it; give one writer "
                "this dataset, or an obstore store (docs/storage.md)",
                location,
            )
        self._dfs = dfs
        self._holders = Holders(
            dfs, self.writer_id, self._claimed.created if self._claimed is not None else None
        )
        self._live = LiveRollouts(
            max_live=self.max_live_rollouts,
            dfs=dfs,
            reader=self._reader,
            holders=self._holders,
            ahead=self._ahead,
            events=self._events,
            rollouts=self._rollouts,
            writer_id=self.writer_id,
        )
        # On object storage other writers commit too: a thread keeps the writer's reader up to
        # date with their units, so a handoff read on the writer thread finds little to index
        # (the units of a few writers pile up fast; indexing them all at once there would stall
        # every call's staging behind it).
        self._following = threading.Event()
        self._follower: threading.Thread | None = None
        if not dfs.local:
            self._follower = threading.Thread(
                target=self._follow, name=f"parquet-follow {location}", daemon=True
            )
            self._follower.start()
        self._writer = UnitWriter(
            dfs,
            name=location,
            max_batch=max_batch,
            last_order=known.last_order,
            publish=self._publish,
            settle=self._settle,
            linger_s=linger_s,
            linger_capped=linger_capped,
        )

    # -- StagingSink ----------------------------------------------------------------------------

    async def stage(
        self, record: StagedCallRecord, *, attachments: Mapping[str, Attachment] | None = None
    ) -> StageResult:
        if not record.digest or not record.extras_digest:
            raise ValueError(f"{record.staging_key}: stage a sealed record (seal_record) only")
        given = dict(attachments or {})
        claim = SeqClaim(record.rollout_id, record.seq, record.staging_key, record.created_at_ms)
        read = await self._ahead.read(record.rollout_id)
        parent = await self._ahead.parent(record)

        def work(batch: UnitRows, part: UnitRows) -> StageResult:
            return self._stage_one(batch, part, record, given, claim, parent)

        result: StageResult = await self._writer.submit(
            Claimed(claim, self._ahead.offer(read, work))
        )
        return result

    async def record_failure(self, entry: LedgerEntry) -> None:
        claim = SeqClaim(entry.rollout_id, entry.seq, entry.call_id, entry.at_ms)

        def work(batch: UnitRows, part: UnitRows) -> None:
            holder = self._holders.holder(claim)
            if holder != entry.call_id:
                self._live.refused(claim, holder)
                raise DuplicateSeq(entry.rollout_id, entry.seq, holder)
            self._live.keys(entry.rollout_id)
            self._ensure_rollout(batch, part, entry.rollout_id)
            part.rows[LEDGER].append(failure_row(entry))
            self._place(batch, part, ledger_event(entry))

        read = await self._ahead.read(entry.rollout_id)
        await self._writer.submit(Claimed(claim, self._ahead.offer(read, work)))

    async def append_event(self, event: EventDraft) -> RolloutEvent:
        """Append `event` to its rollout's chain in the next unit; see
        `StagingSink.append_event`. A claim also creates its claim file, if absent, in the
        store (`_claims`: exclusive and fsynced on a local folder, a conditional ``PUT`` on object
        storage); the claims of one group commit are written at once, before its unit. A claim
        returns once its file is durable: its event needs no unit of its own and commits with
        the next unit written (its call's record or ledger entry, in the common case), or at
        `close`; a crash before then leaves the claim file alone, which readers account for
        (``lost_in_crash``) as they do a claim whose call never ended."""
        if event.kind is not EventKind.CLAIM:

            def plain(batch: UnitRows, part: UnitRows) -> RolloutEvent:
                self._live.keys(event.rollout_id)
                if event.kind is EventKind.SEAL:
                    part.sealed.add(event.rollout_id)
                return self._place(batch, part, event)

            read = await self._ahead.read(event.rollout_id)
            placed: RolloutEvent = await self._writer.submit(self._ahead.offer(read, plain))
            return placed
        assert event.seq is not None
        assert event.call_id is not None
        claim = SeqClaim(event.rollout_id, event.seq, event.call_id, event.at_ms)

        def work(batch: UnitRows, part: UnitRows) -> RolloutEvent:
            holder = self._holders.holder(claim)
            if holder != claim.call_id:
                self._live.refused(claim, holder)
                raise DuplicateSeq(event.rollout_id, claim.seq, holder)
            self._live.keys(event.rollout_id)
            self._ensure_rollout(batch, part, event.rollout_id)
            return self._place(batch, part, event)

        # Durable once its claim file is: the event rides in the next unit written (`_writer`).
        read = await self._ahead.read(event.rollout_id)
        stored: RolloutEvent = await self._writer.submit(
            Claimed(claim, self._ahead.offer(read, work), defer=True)
        )
        return stored

    async def put_rollout(self, info: RolloutInfo) -> None:
        def work(batch: UnitRows, part: UnitRows) -> None:
            sealed = info.state is RolloutState.SEALED
            # The header's revision is its rollout's chain head (`_ledger`): for another
            # writer's rollout, as the store has it now. On a local folder (one writer) a
            # sealed header of a rollout this writer no longer holds (the proxy writes it
            # after the seal event) needs no call ids: its head is the seal's (`EventHeads`).
            if not sealed or info.rollout_id in self._live or not self._dfs.local:
                self._live.keys(info.rollout_id)
            head = self._events.head(batch, part, info.rollout_id)
            part.rows[LEDGER].append(rollout_row(info, -1 if head is None else head[0]))
            part.rollouts.add(info.rollout_id)
            if sealed:
                # Once it commits, what is held of the rollout goes, as after its seal event
                # (an outcome's event, written before its header, brought it back).
                part.sealed.add(info.rollout_id)

        read = await self._ahead.read(info.rollout_id)
        await self._writer.submit(self._ahead.offer(read, work))

    async def mark_orphaned(self, call_id: str, reason: str) -> None:
        def work(batch: UnitRows, part: UnitRows) -> None:
            staged = batch.calls.get(call_id)
            rollout_id = staged[0] if staged else self._live.rollout_of(call_id)
            part.rows[LEDGER].append(orphan_row(call_id, rollout_id, reason, _now_ms()))

        await self._writer.submit(work)

    @property
    def dedup_hits(self) -> int:
        """References to an attachment already stored (not stored again) since the sink opened."""
        return self._shared.hits

    def own_source(self) -> ParquetSource:
        """The writer's own reader on the dataset, lent to the proxy (`SinkWithSource`): one
        index of the store in the process, not two. Thread-safe (its reads are serialized,
        the writer thread's among them); it sees every commit; `close` releases it."""
        return self._reader

    def stats(self) -> dict[str, float]:
        """Writer figures for /metrics (names without the ``capture_proxy_sink_`` prefix)."""
        return {
            **self._writer.stats(),
            "attachment_dedup_hits_total": self.dedup_hits,
            "writer_thread_resolves_total": self._ahead.in_writer,
        }

    async def probe(self) -> None:
        """One small durable write and its removal (``_writer.probe`` at the dataset's root):
        raises what a staging write would raise now. The proxy calls it once a second while
        its sink is failing, so readiness comes back when the store does, with no call needed
        to show it."""

        def work() -> None:
            self._dfs.put_all({PROBE_FILE: self.writer_id.encode()})
            self._dfs.delete(PROBE_FILE)

        await asyncio.to_thread(work)

    async def close(self) -> None:
        """Commit every queued write and stop the writer thread."""
        await self._writer.close()
        self._following.set()
        if self._follower is not None:
            await asyncio.to_thread(self._follower.join)
        self._ahead.close()
        self._reader.close_reader()
        self._fulls.clear()
        self._lock.release()
        if self.store_head is not None:
            self.store_head.close()

    def _follow(self) -> None:
        while not self._following.wait(_FOLLOW_S):
            try:
                # A listing the reader took meanwhile (a read, the proxy's weight version
                # re-read) will do: on object storage each is a request per thousand names.
                self._reader.refresh(max_age_s=_FOLLOW_S)
            except Exception as e:  # a compaction's cleanup, the store unreachable: next time
                log.debug("%s: following other writers' units: %s", self.location, e)

    # -- the writer thread ----------------------------------------------------------------------

    def _publish(self, batch: UnitRows) -> None:
        # Only committed units reach these: a record whose unit failed must not be a parent.
        for call_id, (rollout_id, full) in batch.calls.items():
            self._fulls.put(call_id, (rollout_id, full))
            keys = self._live.get(rollout_id)
            if keys is not None:  # else it left memory: the reader finds the call if it returns
                keys.calls.add(call_id)
        self._shared.publish(batch)
        self._rollouts.update(batch.rollouts)
        self._events.publish(batch)
        if self._claimed is not None:
            self._claimed.committed(batch.rows[LEDGER])
        for rollout_id in handoffs_in(batch):
            keys = self._live.get(rollout_id)
            if keys is not None:
                keys.handoff = None
        for rollout_id in batch.sealed:
            # A sealed rollout takes no more calls once its seal event (or a sealed header)
            # commits; a late ledger entry reads it back (its seq's holder from the claim
            # file). Its full sequences go too: no call will extend them.
            sealed = self._live.drop(rollout_id)
            for call_id in sealed.calls if sealed is not None else ():
                self._fulls.pop(call_id)
            self._holders.forget(rollout_id)
            self._events.retire(rollout_id)  # an outcome's event set it again
            if self._claimed is not None:
                self._claimed.forget(rollout_id)

    def _settle(self, works: list[Work]) -> None:
        # The claims the batch's work holds seqs by, written at once before the batch runs.
        self._holders.settle([w.claim for w in works if isinstance(w, Claimed)])

    def _place(self, batch: UnitRows, part: UnitRows, draft: EventDraft) -> RolloutEvent:
        """Chain `draft` in its rollout's log, after the ``handoff`` event due first, if any."""
        rollout_id = draft.rollout_id
        keys = self._live.get(rollout_id)
        if (
            keys is not None
            and keys.handoff is not None
            and rollout_id not in handoffs_in(batch) | handoffs_in(part)
        ):
            handoff = EventDraft(rollout_id, EventKind.HANDOFF, _now_ms(), body=keys.handoff)
            self._events.place(batch, part, handoff)
        return self._events.place(batch, part, draft)

    def _stored_head(self, rollout_id: str) -> tuple[int, str] | None:
        """The last committed event of a rollout whose head was dropped (sealed)."""
        if rollout_id not in self._rollouts:
            return None  # new: no event of it is stored
        return stored_chain(self._reader, rollout_id)[0]

    async def prepare_rollout(self, rollout_id: str) -> None:
        """Read from the store now what this writer's next write of `rollout_id` needs (its
        highest claim and chain head), in a worker thread, so that write does not wait for it
        (`LiveRollouts.keys`): the proxy calls this as it resumes a rollout (a hand-off from another
        proxy, or back), within ``--rollout-resume-timeout``. Nothing on a local folder."""
        await self._ahead.prepare(rollout_id)

    def _ensure_rollout(self, batch: UnitRows, part: UnitRows, rollout_id: str) -> None:
        if rollout_id in self._rollouts or rollout_id in batch.rollouts:
            return
        implicit = rollout_row(RolloutInfo(rollout_id, RolloutState.OPEN, False, _now_ms()))
        part.rows[LEDGER].append({**implicit, "reason": IMPLICIT})
        part.rollouts.add(rollout_id)

    def _parent_full(
        self, batch: UnitRows, record: StagedCallRecord, ahead: tuple[str, array[int]] | None
    ) -> array[int] | None:
        parent = record.parent_call_id
        if parent is None:
            return None
        hit = batch.calls.get(parent) or self._fulls.get(parent)
        if hit is None and ahead is not None and ahead[0] == parent:
            hit = self._fulls.put(parent, (record.rollout_id, ahead[1]))  # read before queued
        if hit is None:
            if parent not in self._live.keys(record.rollout_id).calls:
                return None  # not staged here, or another rollout's: store the call whole
            if not self._dfs.local:
                return None  # not read in time before it was queued (`ReadAhead.parent`)
            try:
                full = self._reader.full(parent, record.rollout_id)
                hit = self._fulls.put(parent, (record.rollout_id, full))
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
        claim: SeqClaim,
        parent: tuple[str, array[int]] | None = None,
    ) -> StageResult:
        key = record.staging_key
        # The seq first: a record refused it needs nothing of its rollout (whose state, when
        # another writer continued it, this writer has just dropped: `_refused`).
        holder = self._holders.holder(claim)
        if holder != key:
            self._live.refused(claim, holder)
            return StageResult.failed(
                "duplicate_seq", str(DuplicateSeq(record.rollout_id, record.seq, holder))
            )
        if key in batch.calls or key in self._live.keys(record.rollout_id).calls:
            return StageResult.failed("duplicate_key", f"staging key {key} is already staged")
        new = self._shared.attachments_to_store(batch, record, given)
        if isinstance(new, StageResult):
            return new
        encoded = encode_record(record, self._parent_full(batch, record, parent), given)
        part.rows[CALLS].append(encoded.row)
        part.calls[key] = (record.rollout_id, encoded.full)
        self._shared.add_blobs(batch, part, encoded.blobs)
        if self.fault is not None:
            self.fault("after_record")
        self._shared.add_attachments(part, new)
        if self.fault is not None:
            self.fault("after_attachments")
        self._ensure_rollout(batch, part, record.rollout_id)
        self._place(batch, part, staged_event(record, _now_ms()))
        row = encoded.row
        return StageResult.staged(coords_for(self.url, record, row))
