"""`SQLiteSource`: read a SQLite store back (synchronous, read-only, plain `sqlite3`)."""

from __future__ import annotations

import os
import sqlite3
import threading
import urllib.parse
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import orjson

from ...schemas.events import RolloutEvent
from ...schemas.outcome import split_header_metadata
from ...schemas.records import (
    Attachment,
    CallStatus,
    CallSummary,
    CommitCoords,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from ..base import PROXY_STATE_ROLLOUT, StoreDamaged, StoreError, StoreFormatError
from ..codec import decode_row, stored_bytes
from ..rollout_index import IndexedRollout, RolloutQuery
from ._cursors import SQLiteCursors
from ._schema import (
    FORMAT_VERSION,
    READABLE_FROM,
    TokenLRU,
    call_columns,
    has_events,
    has_index,
    has_reference_types,
    outcome_columns,
    read_format,
    rebuild_full,
    unpack_blob,
)

__all__ = ["SQLiteSource"]

#: Full sequences kept while decoding one `calls` / `fetch`: enough for a session's parents
#: without holding every ancestor of a long rollout in memory.
_DECODE_CACHE_TOKENS = 2_000_000


def _int(value: object, what: str) -> int:
    """An integer column's value, as a writer stores it: an int (not a float, text or bytes,
    which SQLite would keep in any column of a crafted file)."""
    if type(value) is not int:
        raise TypeError(f"{what} is {type(value).__name__} {value!r:.40}, not an integer")
    return value


def _text(value: object, what: str) -> str:
    if type(value) is not str:
        raise TypeError(f"{what} is {type(value).__name__} {value!r:.40}, not text")
    return value


def _object(value: object, what: str) -> dict[str, Any]:
    """A JSON object column (metadata, policy, an event's body)."""
    if not isinstance(value, (str, bytes)):
        raise TypeError(f"{what} is {type(value).__name__}, not JSON text")
    loaded = orjson.loads(value)
    if not isinstance(loaded, dict):
        raise TypeError(f"{what} is JSON {type(loaded).__name__}, not an object")
    return loaded


class _Decoder:
    """Decodes rows within one read, reusing parents' sequences, blobs and attachments."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        columns: Sequence[str],
        reference_types: bool,
        refused: dict[str, str] | None = None,
    ) -> None:
        self.conn = conn
        #: Blobs found past their size limit (key -> why), shared by the reads of one source:
        #: a blob is inflated up to the limit once, then refused at once.
        self.refused = refused if refused is not None else {}
        self.columns = columns
        self.fulls = TokenLRU(_DECODE_CACHE_TOKENS)
        self.blobs: dict[str, bytes] = {}
        # Keyed by (sha256, media type): one stored copy of the bytes can be referred to under
        # several media types, each its own `Attachment` sharing the bytes.
        self.attachments: dict[tuple[str, str], Attachment] = {}
        self.attachment_data: dict[str, bytes] = {}
        # A reference's own media type (format 6), else the one stored with the bytes.
        self._attachments_sql = (
            "SELECT ca.sha256, "
            + ("COALESCE(ca.media_type, a.media_type)" if reference_types else "a.media_type")
            + ", a.data FROM call_attachments ca JOIN attachments a ON a.sha256 = ca.sha256"
            " WHERE ca.call_id = ? ORDER BY ca.ord"
        )

    def blob(self, key: str) -> bytes:
        data = self.blobs.get(key)
        if data is None:
            row = self.conn.execute(
                "SELECT data, codec FROM blobs WHERE key = ?", (key,)
            ).fetchone()
            if row is None:
                raise KeyError(f"blob {key} is missing")
            if key in self.refused:
                raise ValueError(self.refused[key])
            try:
                data = unpack_blob(key, stored_bytes(row[0], "blob"), row[1])
            except ValueError as e:
                self.refused[key] = str(e)
                raise
            self.blobs[key] = data
        return data

    def attachments_of(self, call_id: str) -> list[Attachment]:
        out = []
        for sha, media_type, data in self.conn.execute(self._attachments_sql, (call_id,)):
            att = self.attachments.get((sha, media_type))
            if att is None:
                kept = self.attachment_data.setdefault(sha, stored_bytes(data, "attachment"))
                att = Attachment(sha, media_type, kept)
                self.attachments[(sha, media_type)] = att
            out.append(att)
        return out

    def record(self, values: Sequence[Any]) -> StagedCallRecord:
        row = dict(zip(self.columns, values, strict=True))
        call_id, parent = row["call_id"], row["parent_call_id"]
        parent_full: array[int] | None = None
        if row["prev_len"]:
            if parent is None:
                raise ValueError(f"{call_id}: stored as a delta but names no parent")
            parent_full = rebuild_full(self.conn, parent, self.fulls)
            if parent_full is None:
                raise ValueError(f"{call_id}: its parent {parent} is missing from the store")
        record, full = decode_row(row, self.blob, parent_full, self.attachments_of(call_id))
        self.fulls.put(call_id, record.rollout_id, full)
        return record


class SQLiteSource:
    """A `StagingSource` over a SQLite store, opened read-only (safe beside a live writer).

    Raises `StoreError` when `path` does not exist or is not a capture-proxy store, and
    `StoreFormatError` when it was written by a newer capture-proxy. Each method reads one
    consistent snapshot. Safe to share between threads (calls are serialized).
    """

    def __init__(self, path: str, *, url: str | None = None) -> None:
        self.path = str(path)
        self.url = url or f"sqlite:///{self.path}"
        if not os.path.isfile(self.path):
            raise StoreError(f"no capture-proxy store at {self.path}: the file does not exist")
        uri = "file:" + urllib.parse.quote(os.path.abspath(self.path)) + "?mode=ro"
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open the SQLite store {self.path}: {e}") from e
        try:
            version = read_format(conn, self.path)
        except BaseException:
            conn.close()
            raise
        if version == 0:
            conn.close()
            raise StoreError(f"{self.path} is not a capture-proxy store (it holds no tables)")
        if version < READABLE_FROM:
            conn.close()
            raise StoreFormatError(
                f"{self.path} has the older format {version} (this capture-proxy reads "
                f"{READABLE_FROM} to {FORMAT_VERSION}): open it once for writing to migrate it"
            )
        self._conn = conn
        self._lock = threading.Lock()
        # A file a writer has not migrated yet lacks the newest columns: read what it has, and
        # its rows decode as the record versions they were written as.
        self._columns = call_columns(version)
        self._has_events = has_events(version)
        self._reference_types = has_reference_types(version)
        self._has_index = has_index(version)
        self._cursors: SQLiteCursors | None = None
        self._select_calls = f"SELECT {', '.join(self._columns)} FROM calls"
        self._refused_blobs: dict[str, str] = {}

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        # One read transaction per method: a record, its blobs and its attachments come from the
        # same snapshot even while a writer commits. What a method decodes inside it, it decodes
        # strictly (`_int`, `_text`, the codec): a value no writer stores ends the read as
        # `StoreDamaged`, never as a TypeError three frames later.
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                yield self._conn
            except (KeyError, StoreError):
                raise
            except (ValueError, TypeError, OverflowError, UnicodeError, IndexError) as e:
                raise StoreDamaged(
                    f"{self.path} is damaged ({type(e).__name__}: {e}); "
                    "capture-proxy inspect --verify lists the damage"
                ) from e
            finally:
                self._conn.execute("COMMIT")

    def rollouts(self) -> list[str]:
        with self._read() as c:
            rows = c.execute(
                "SELECT id FROM rollouts WHERE id != ? ORDER BY created_at_ms, rowid",
                (PROXY_STATE_ROLLOUT,),
            )
            return [_text(r[0], "rollout id") for r in rows]

    def indexed_rollouts(self, query: RolloutQuery) -> list[IndexedRollout]:
        """The rollouts `query` keeps, through the ``rollouts`` indexes (format 7): a query by
        state, seal time or group reads the rows it returns (and their ledgers' capture
        failures and orphan marks), not the table. An older file is answered from its headers'
        metadata, row by row."""
        where = ["id != ?"]
        args: list[object] = [PROXY_STATE_ROLLOUT]
        if query.since_ms is not None or query.state == "sealed":
            where.append("state = 'sealed'")
        elif query.state == "open":
            where.append("state = 'open'")
        if query.since_ms is not None:
            where.append("sealed_at_ms >= ?")
            args.append(max(-(2**63), min(query.since_ms, 2**63 - 1)))  # SQLite's integers
        if self._has_index:
            if query.groups is not None:
                where.append(f"group_id IN ({', '.join('?' * len(query.groups))})")
                args.extend(sorted(query.groups))
            if query.graded is not None:
                where.append("graded = ?")
                args.append(int(query.graded))
            columns = "group_id, graded"
        else:
            columns = "metadata, NULL"
        sql = (
            f"SELECT id, state, created_at_ms, sealed_at_ms, {columns},"
            " EXISTS (SELECT 1 FROM failures f WHERE f.rollout_id = r.id AND f.status = ?)"
            " OR EXISTS (SELECT 1 FROM orphaned o JOIN calls c ON c.call_id = o.call_id"
            " WHERE c.rollout_id = r.id)"
            f" FROM rollouts r WHERE {' AND '.join(where)} ORDER BY created_at_ms, rowid"
        )
        with self._read() as c:
            rows = c.execute(sql, (CallStatus.CAPTURE_FAILED.value, *args)).fetchall()
        out = []
        for rid, state, created, sealed, group_id, graded, poisoned in rows:
            if not self._has_index:
                group_id, graded = outcome_columns(group_id)
            row = IndexedRollout(
                rid, state, bool(poisoned), int(created), sealed, group_id, bool(graded)
            )
            if query.matches(row):
                out.append(row)
        return out

    def consumer_cursors(self) -> SQLiteCursors:
        """The consumers' cursors of this file (`capture_proxy.sinks.cursors`)."""
        with self._lock:
            if self._cursors is None:
                self._cursors = SQLiteCursors(os.path.abspath(self.path))
            return self._cursors

    def rollout_info(self, rollout_id: str) -> RolloutInfo:
        with self._read() as c:
            row = c.execute(
                "SELECT state, created_at_ms, sealed_at_ms, metadata, policy FROM rollouts"
                " WHERE id = ?",
                (rollout_id,),
            ).fetchone()
            if row is None:
                raise KeyError(f"no rollout {rollout_id!r} in {self.url}")
            poisoned = c.execute(
                "SELECT EXISTS (SELECT 1 FROM failures WHERE rollout_id = ? AND status = ?)"
                " OR EXISTS (SELECT 1 FROM orphaned o JOIN calls c ON c.call_id = o.call_id"
                " WHERE c.rollout_id = ?)",
                (rollout_id, CallStatus.CAPTURE_FAILED.value, rollout_id),
            ).fetchone()[0]
            state, created, sealed, metadata, policy = row
            driver_metadata, outcomes = split_header_metadata(_object(metadata, "metadata"))
            return RolloutInfo(
                rollout_id,
                RolloutState(_text(state, "state")),
                bool(poisoned),
                _int(created, "created_at_ms"),
                None if sealed is None else _int(sealed, "sealed_at_ms"),
                driver_metadata,
                _object(policy, "policy"),
                outcomes,
            )

    def calls(self, rollout_id: str, *, include_orphaned: bool = False) -> list[StagedCallRecord]:
        where = "" if include_orphaned else " AND call_id NOT IN (SELECT call_id FROM orphaned)"
        with self._read() as c:
            rows = c.execute(
                f"{self._select_calls} WHERE rollout_id = ?{where} ORDER BY seq, rowid",
                (rollout_id,),
            ).fetchall()
            decoder = _Decoder(c, self._columns, self._reference_types, self._refused_blobs)
            return [decoder.record(r) for r in rows]

    def failures(self, rollout_id: str) -> list[LedgerEntry]:
        with self._read() as c:
            rows = c.execute(
                "SELECT call_id, seq, status, reason, message, http_status, at_ms FROM failures"
                " WHERE rollout_id = ? ORDER BY seq, rowid",
                (rollout_id,),
            ).fetchall()
            return [
                LedgerEntry(
                    rollout_id,
                    _text(call_id, "call_id"),
                    _int(seq, "seq"),
                    CallStatus(status),
                    _text(reason, "reason"),
                    _text(msg, "message"),
                    None if http is None else _int(http, "http_status"),
                    _int(at_ms, "at_ms"),
                )
                for call_id, seq, status, reason, msg, http, at_ms in rows
            ]

    def events(self, rollout_id: str) -> list[RolloutEvent]:
        if not self._has_events:  # written before event logs: nothing to check
            return []
        with self._read() as c:
            rows = c.execute(
                "SELECT position, kind, seq, call_id, at_ms, body, prev_hash, hash FROM events"
                " WHERE rollout_id = ? ORDER BY position",
                (rollout_id,),
            ).fetchall()
            return [
                RolloutEvent(
                    rollout_id,
                    _int(pos, "position"),
                    _text(kind, "kind"),
                    None if seq is None else _int(seq, "seq"),
                    None if cid is None else _text(cid, "call_id"),
                    _int(at, "at_ms"),
                    _object(body, "body"),
                    _text(prev, "prev_hash"),
                    _text(digest, "hash"),
                )
                for pos, kind, seq, cid, at, body, prev, digest in rows
            ]

    def claims(self, rollout_id: str) -> dict[int, str]:
        if not self._has_events:
            return {}
        with self._read() as c:
            rows = c.execute(
                "SELECT seq, call_id FROM events WHERE rollout_id = ? AND kind = 'claim'"
                " ORDER BY seq",
                (rollout_id,),
            ).fetchall()
            return {_int(seq, "seq"): _text(cid, "call_id") for seq, cid in rows}

    def summaries(self, rollout_id: str) -> list[CallSummary]:
        # One pass over the (rollout_id, seq) index; the token and logprob blobs are stored after
        # every column read here, so SQLite never reads their pages.
        with self._read() as c:
            rows = c.execute(
                "SELECT call_id, seq, parent_call_id, retry_of, finish_reason, prompt_len,"
                " cum_len, prev_len, created_at_ms, weight_version,"
                " call_id IN (SELECT call_id FROM orphaned)"
                " FROM calls WHERE rollout_id = ? ORDER BY seq, rowid",
                (rollout_id,),
            ).fetchall()
            return [
                CallSummary(
                    _text(cid, "call_id"),
                    _int(seq, "seq"),
                    None if parent is None else _text(parent, "parent_call_id"),
                    None if retry is None else _text(retry, "retry_of"),
                    _text(finish, "finish_reason"),
                    _int(p, "prompt_len"),
                    _int(cum, "cum_len") - _int(p, "prompt_len"),
                    _int(cum, "cum_len"),
                    _int(prev, "prev_len"),
                    _int(at, "created_at_ms"),
                    _int(wv, "weight_version"),
                    bool(o),
                )
                for cid, seq, parent, retry, finish, p, cum, prev, at, wv, o in rows
            ]

    def fetch(self, keys: Sequence[str]) -> list[StagedCallRecord]:
        with self._read() as c:
            decoder = _Decoder(c, self._columns, self._reference_types, self._refused_blobs)
            out = []
            for key in keys:
                row = c.execute(f"{self._select_calls} WHERE call_id = ?", (key,)).fetchone()
                if row is None:
                    raise KeyError(f"no staged record {key!r} in {self.url}")
                out.append(decoder.record(row))
            return out

    def coords(self, keys: Sequence[str]) -> list[CommitCoords]:
        out = []
        with self._read() as c:
            for key in keys:
                row = c.execute(
                    "SELECT digest, extras_digest, prev_len, delta_len, cum_len, weight_version"
                    " FROM calls WHERE call_id = ?",
                    (key,),
                ).fetchone()
                if row is None:
                    raise KeyError(f"no staged record {key!r} in {self.url}")
                digest, extras_digest, prev_len, delta_len, cum_len, weight_version = row
                out.append(
                    CommitCoords(
                        self.url,
                        key,
                        _text(digest, "digest"),
                        _text(extras_digest, "extras_digest"),
                        _int(prev_len, "prev_len"),
                        _int(delta_len, "delta_len"),
                        _int(cum_len, "cum_len"),
                        _int(weight_version, "weight_version"),
                    )
                )
        return out

    def orphaned(self) -> set[str]:
        with self._read() as c:
            return {r[0] for r in c.execute("SELECT call_id FROM orphaned")}

    def all_keys(self) -> list[str]:
        with self._read() as c:
            return [
                _text(r[0], "call_id")
                for r in c.execute("SELECT call_id FROM calls ORDER BY rowid")
            ]

    def unreferenced_attachments(self) -> list[str]:
        with self._read() as c:
            rows = c.execute(
                "SELECT sha256 FROM attachments WHERE sha256 NOT IN"
                " (SELECT sha256 FROM call_attachments) ORDER BY sha256"
            )
            return [r[0] for r in rows]

    def close_reader(self) -> None:
        with self._lock:
            self._conn.close()
            if self._cursors is not None:
                self._cursors.close()
