"""`SQLiteSink`: stage records into one SQLite file, with group commit.

Durability: the file is in WAL mode with ``synchronous=FULL``, and `stage` returns only after the
``COMMIT`` holding its record has returned, so an acknowledged record survives a process kill *and*
a power loss. (``synchronous=NORMAL`` is the usual WAL choice and is crash-safe against a process
kill, but it does not sync the WAL at each commit: a power loss can lose the last commits, which
the caller was already told were durable.)

Throughput comes from group commit (`_writer.GroupCommitWriter`), not from a weaker sync:
concurrent `stage` calls share one transaction and one fsync, each record in its own savepoint so
a refused or failing record rolls back alone. The record, its message blobs, its new attachments
and its attachment references are written in that one savepoint: a crash at any moment leaves all
of them or none.

One writer per file: the sink holds a lock file beside the store for its whole life, and refuses
to acknowledge anything once the file at its path is no longer the one it writes (deleted or
replaced under it); `_file` says how and why.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from array import array
from collections.abc import Mapping
from pathlib import Path

import orjson

from ...schemas.events import (
    EventDraft,
    EventKind,
    RolloutEvent,
    chain_event,
    ledger_event,
    staged_event,
)
from ...schemas.outcome import header_metadata
from ...schemas.records import (
    Attachment,
    LedgerEntry,
    RolloutInfo,
    StagedCallRecord,
    StageResult,
)
from ...schemas.store_head import StoreHeadState
from ..base import DuplicateSeq, FaultHook, StoreError
from ..codec import encode_record
from ..staging_rules import coords_for, new_attachments
from ..store_head import StoreHeadKeeper
from ._file import FileIdentity, WriterLock
from ._schema import (
    CALL_COLUMNS,
    TokenLRU,
    pack_blob,
    read_format,
    rebuild_full,
    upgrade,
)
from ._source import SQLiteSource
from ._writer import Batch, GroupCommitWriter

__all__ = ["SQLiteSink", "SQLiteSource"]

#: Bytes of a probe write (`SQLiteSink.probe`): a small call's record and its events.
_PROBE_BYTES = 64 << 10

log = logging.getLogger(__name__)

_INSERT_CALL = (
    f"INSERT INTO calls ({', '.join(CALL_COLUMNS)}) VALUES ({', '.join('?' * len(CALL_COLUMNS))})"
)
_ENSURE_ROLLOUT = (
    "INSERT OR IGNORE INTO rollouts (id, state, created_at_ms, sealed_at_ms, metadata, policy)"
    " VALUES (?, 'open', ?, NULL, '{}', '{}')"
)


def _has_attachment(conn: sqlite3.Connection, sha: str) -> bool:
    return conn.execute("SELECT 1 FROM attachments WHERE sha256 = ?", (sha,)).fetchone() is not None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _seq_holder(conn: sqlite3.Connection, rollout_id: str, seq: int, call_id: str) -> str | None:
    """Another call already at (rollout_id, seq): claimed, staged or in the ledger (format 3's
    rule, and format 5's claims; checked here first so the refusal names the seq, the triggers
    and the claims' unique index being the last word)."""
    row = conn.execute(
        "SELECT call_id FROM events WHERE rollout_id = ? AND seq = ? AND kind = 'claim'"
        " AND call_id != ?",
        (rollout_id, seq, call_id),
    ).fetchone()
    if row is not None:
        return str(row[0])
    for table in ("calls", "failures"):
        row = conn.execute(
            f"SELECT call_id FROM {table} WHERE rollout_id = ? AND seq = ? AND call_id != ?"
            " LIMIT 1",
            (rollout_id, seq, call_id),
        ).fetchone()
        if row is not None:
            return str(row[0])
    return None


def _append_event(conn: sqlite3.Connection, batch: Batch, draft: EventDraft) -> RolloutEvent:
    """Place `draft` after its rollout's last event, inside the caller's savepoint: the head is
    read in the same transaction, so the chain holds exactly what commits."""
    head = conn.execute(
        "SELECT position, hash FROM events WHERE rollout_id = ? ORDER BY position DESC LIMIT 1",
        (draft.rollout_id,),
    ).fetchone()
    event = chain_event(draft, None if head is None else (int(head[0]), str(head[1])))
    conn.execute(
        "INSERT INTO events (rollout_id, position, kind, seq, call_id, at_ms, body, prev_hash,"
        " hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            event.rollout_id,
            event.position,
            event.kind,
            event.seq,
            event.call_id,
            event.at_ms,
            orjson.dumps(dict(event.body)).decode(),
            event.prev_hash,
            event.hash,
        ),
    )
    batch.events.append(event)
    return event


def _store_head_state(conn: sqlite3.Connection) -> StoreHeadState:
    """The store head of the file as it is (`schemas.store_head`): every rollout's last event."""
    # SQLite gives the bare columns of the row that holds the MAX.
    rows = conn.execute("SELECT rollout_id, hash, MAX(position) FROM events GROUP BY rollout_id")
    return StoreHeadState.of((str(r), str(h), int(p)) for r, h, p in rows)


def _open_writer(path: str) -> sqlite3.Connection:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        # check_same_thread=False: opened here (so errors reach the constructor's caller), then
        # used by the writer thread only.
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as e:
        raise StoreError(f"cannot open the SQLite store {path}: {e}") from e
    try:
        # Check that the file is ours before changing anything in it (journal mode included).
        read_format(conn, path)
        conn.execute("PRAGMA busy_timeout = 10000")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"{path}: SQLite refused WAL mode (got {mode!r})")
        conn.execute("PRAGMA synchronous = FULL")  # see the module docstring
        upgrade(conn, path)
    except sqlite3.Error as e:
        conn.close()
        raise StoreError(f"cannot open the SQLite store {path}: {e}") from e
    except BaseException:
        conn.close()
        raise
    return conn


class SQLiteSink:
    """A `StagingSink` writing one SQLite file (created, with its folders, when missing).

    Construct it once at startup: the constructor takes the store's writer lock (raising
    `StoreError`, naming the other writer's pid, while another sink holds it), opens the file,
    checks its format (raising `StoreError` / `StoreFormatError`) and starts the writer thread.
    `close` finishes every queued write and releases the lock. Once the file at `path` is
    deleted or replaced, every write fails with `StoreError` and `problem` says why.

    `fault` is a test hook called at ``"after_record"`` and ``"after_attachments"`` inside each
    record's write; `max_batch` caps how many queued writes share one commit; `cache_tokens`
    bounds the cache of recent full sequences used to store children as deltas.
    """

    def __init__(
        self,
        path: str,
        *,
        url: str | None = None,
        fault: FaultHook | None = None,
        max_batch: int = 256,
        cache_tokens: int = 4_000_000,
    ) -> None:
        self.path = str(path)
        self.url = url or f"sqlite:///{self.path}"
        self.fault = fault
        self.dedup_hits = 0
        self._fulls = TokenLRU(cache_tokens)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = WriterLock(self.path)
        try:
            conn = _open_writer(self.path)
            try:
                self.identity = FileIdentity(self.path)
                self.store_head = StoreHeadKeeper(self.path, _store_head_state(conn))
            except OSError as e:
                conn.close()
                raise StoreError(f"cannot open the SQLite store {self.path}: {e}") from e
        except BaseException:
            self._lock.release()
            raise
        self._writer = GroupCommitWriter(
            conn,
            name=self.path,
            max_batch=max_batch,
            publish=self._publish,
            check=self.identity.check,
        )

    # -- StagingSink -------------------------------------------------------------------------

    async def stage(
        self, record: StagedCallRecord, *, attachments: Mapping[str, Attachment] | None = None
    ) -> StageResult:
        """Write `record` and the attachments its request refers to; see `StagingSink.stage`.

        Returns once the batch holding it has committed (durable). Refuses, writing nothing:
        a staging key already staged (``duplicate_key``), a seq another call of the rollout
        already holds (``duplicate_seq``), a reference to an attachment neither
        given nor already stored (``missing_attachment``), given bytes that do not hash to their
        sha256 (``bad_attachment``). Given attachments the request does not refer to are not
        stored: nothing would refer to them. Raises `StoreError` when SQLite fails, ValueError
        for an unsealed record, RuntimeError after `close`.
        """
        if not record.digest or not record.extras_digest:
            raise ValueError(f"{record.staging_key}: stage a sealed record (seal_record) only")
        given = dict(attachments or {})
        result: StageResult = await self._writer.submit(
            lambda conn, batch: self._stage_one(conn, batch, record, given)
        )
        return result

    async def record_failure(self, entry: LedgerEntry) -> None:
        def work(conn: sqlite3.Connection, batch: Batch) -> None:
            holder = _seq_holder(conn, entry.rollout_id, entry.seq, entry.call_id)
            if holder is not None:
                raise DuplicateSeq(entry.rollout_id, entry.seq, holder)
            conn.execute(_ENSURE_ROLLOUT, (entry.rollout_id, _now_ms()))
            conn.execute(
                "INSERT INTO failures (rollout_id, call_id, seq, status, reason, message,"
                " http_status, at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    entry.rollout_id,
                    entry.call_id,
                    entry.seq,
                    entry.status.value,
                    entry.reason,
                    entry.message,
                    entry.http_status,
                    entry.at_ms,
                ),
            )
            _append_event(conn, batch, ledger_event(entry))

        await self._writer.submit(work)

    async def append_event(self, event: EventDraft) -> RolloutEvent:
        """Append `event` to its rollout's chain in the next group commit; see
        `StagingSink.append_event`. A claim of a seq already held raises `DuplicateSeq`."""

        def work(conn: sqlite3.Connection, batch: Batch) -> RolloutEvent:
            if event.kind is EventKind.CLAIM:
                assert event.seq is not None
                assert event.call_id is not None
                holder = _seq_holder(conn, event.rollout_id, event.seq, event.call_id)
                if holder is None:
                    row = conn.execute(
                        "SELECT call_id FROM events WHERE rollout_id = ? AND seq = ?"
                        " AND kind = 'claim'",
                        (event.rollout_id, event.seq),
                    ).fetchone()
                    holder = None if row is None else str(row[0])
                if holder is not None:
                    raise DuplicateSeq(event.rollout_id, event.seq, holder)
                conn.execute(_ENSURE_ROLLOUT, (event.rollout_id, _now_ms()))
            return _append_event(conn, batch, event)

        stored: RolloutEvent = await self._writer.submit(work)
        return stored

    async def put_rollout(self, info: RolloutInfo) -> None:
        def work(conn: sqlite3.Connection, batch: Batch) -> None:
            conn.execute(
                "INSERT INTO rollouts (id, state, created_at_ms, sealed_at_ms, metadata, policy,"
                " group_id, graded) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET"
                " state = excluded.state, created_at_ms = excluded.created_at_ms,"
                " sealed_at_ms = excluded.sealed_at_ms, metadata = excluded.metadata,"
                " policy = excluded.policy, group_id = excluded.group_id,"
                " graded = excluded.graded",
                (
                    info.rollout_id,
                    info.state.value,
                    info.created_at_ms,
                    info.sealed_at_ms,
                    orjson.dumps(header_metadata(info.metadata, info.outcome_history)).decode(),
                    orjson.dumps(dict(info.policy)).decode(),
                    # The rollout index (format 7): the latest outcome's group, and graded.
                    None if info.outcome is None else info.outcome.group_id,
                    int(info.outcome is not None),
                ),
            )

        await self._writer.submit(work)

    async def mark_orphaned(self, call_id: str, reason: str) -> None:
        def work(conn: sqlite3.Connection, batch: Batch) -> None:
            conn.execute(
                "INSERT OR REPLACE INTO orphaned (call_id, reason, at_ms) VALUES (?, ?, ?)",
                (call_id, reason, _now_ms()),
            )

        await self._writer.submit(work)

    def problem(self) -> str | None:
        """Why this sink cannot store anything now (its file was deleted or replaced), or None.

        Blocking (one ``stat``): call it from a thread. The proxy's guard asks once a second."""
        return self.identity.problem()

    def stats(self) -> dict[str, float]:
        """Writer figures for /metrics (names without the ``capture_proxy_sink_`` prefix)."""
        return {**self._writer.stats(), "attachment_dedup_hits_total": self.dedup_hits}

    async def probe(self) -> None:
        """One committed write of 64 KiB (the ``writer_probe`` key of ``meta``, replaced each
        time): raises what staging a call of that size would raise now. The proxy calls it once
        a second while its sink is failing, so readiness comes back when the disk does, with no
        call needed to show it. A few bytes would fit in a page the file already has."""
        stamp = f"{time.time_ns()} ".ljust(_PROBE_BYTES, ".")

        def work(conn: sqlite3.Connection, batch: Batch) -> None:
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('writer_probe', ?)", (stamp,)
            )

        await self._writer.submit(work)

    @property
    def incomplete(self) -> str | None:
        """After `close`: why the database file alone does not hold every record (an outside
        reader on an older snapshot kept WAL frames out of it), or None when it does."""
        return self._writer.incomplete

    async def close(self) -> None:
        """Finish every queued write, stop the writer thread and close the file (folding the
        WAL into it; see `incomplete`).

        `stage` after `close` raises RuntimeError."""
        try:
            await self._writer.close()
            self.store_head.close()
        finally:
            self._lock.release()

    # -- the writer thread -----------------------------------------------------------------

    def _publish(self, batch: Batch) -> None:
        # Only committed sequences enter the cache: a rolled-back parent must not be extended.
        for call_id, (rollout_id, full) in batch.pending.items():
            self._fulls.put(call_id, rollout_id, full)
        self.store_head.committed((e.rollout_id, e.prev_hash, e.hash) for e in batch.events)

    def _parent_full(
        self, conn: sqlite3.Connection, batch: Batch, record: StagedCallRecord
    ) -> array[int] | None:
        parent = record.parent_call_id
        if parent is None:
            return None
        hit = batch.pending.get(parent) or self._fulls.get(parent)
        if hit is None:
            row = conn.execute("SELECT rollout_id FROM calls WHERE call_id = ?", (parent,))
            found = row.fetchone()
            if found is None or found[0] != record.rollout_id:
                return None
            try:
                # Not in this batch and not cached, so committed earlier: safe to cache.
                full = rebuild_full(conn, parent, self._fulls)
            except ValueError as e:
                # Storing this call whole keeps it exact; `verify` reports the damaged ancestor.
                log.warning(
                    "%s: storing whole, its parent cannot be rebuilt: %s", record.call_id, e
                )
                return None
            return full
        rollout_id, full = hit
        return full if rollout_id == record.rollout_id else None

    def _stage_one(
        self,
        conn: sqlite3.Connection,
        batch: Batch,
        record: StagedCallRecord,
        given: dict[str, Attachment],
    ) -> StageResult:
        key = record.staging_key
        if conn.execute("SELECT 1 FROM calls WHERE call_id = ?", (key,)).fetchone():
            return StageResult.failed("duplicate_key", f"staging key {key} is already staged")
        holder = _seq_holder(conn, record.rollout_id, record.seq, key)
        if holder is not None:
            return StageResult.failed(
                "duplicate_seq", str(DuplicateSeq(record.rollout_id, record.seq, holder))
            )
        refs = list(dict.fromkeys(record.attachment_refs()))
        checked = new_attachments(record, given, lambda sha: _has_attachment(conn, sha))
        if isinstance(checked, StageResult):
            return checked
        new, hits = checked
        self.dedup_hits += hits
        encoded = encode_record(record, self._parent_full(conn, batch, record), given)
        row = encoded.row
        # A session re-sends its history every call: look each blob up (a primary-key probe)
        # before compressing it, so only new messages pay for zlib.
        fresh = [
            (k, *pack_blob(v))
            for k, v in encoded.blobs.items()
            if conn.execute("SELECT 1 FROM blobs WHERE key = ?", (k,)).fetchone() is None
        ]
        conn.executemany("INSERT OR IGNORE INTO blobs (key, data, codec) VALUES (?, ?, ?)", fresh)
        conn.execute(_INSERT_CALL, [row[c] for c in CALL_COLUMNS])
        if self.fault is not None:
            self.fault("after_record")
        conn.executemany(
            "INSERT OR IGNORE INTO attachments (sha256, media_type, size, data)"
            " VALUES (?, ?, ?, ?)",
            [(a.sha256, a.media_type, a.size, a.data) for a in new],
        )
        conn.executemany(
            "INSERT INTO call_attachments (call_id, sha256, ord, media_type) VALUES (?, ?, ?, ?)",
            [
                (key, sha, i, media_type)
                for i, (sha, media_type) in enumerate(
                    zip(refs, row["attachment_media_types"], strict=True)
                )
            ],
        )
        if self.fault is not None:
            self.fault("after_attachments")
        conn.execute(_ENSURE_ROLLOUT, (record.rollout_id, _now_ms()))
        _append_event(conn, batch, staged_event(record, _now_ms()))
        batch.pending[key] = (record.rollout_id, encoded.full)
        return StageResult.staged(coords_for(self.url, record, row))
