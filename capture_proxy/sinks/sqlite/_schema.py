"""The SQLite store's on-disk format: tables, the format version and its migrations.

One file holds everything (docs/storage.md describes it):

* ``meta``: ``application`` (always ``capture-proxy``) and ``format_version`` (an integer).
* ``calls``: one row per staged record, the columns of `sinks.codec.ROW_FIELDS` (its
  ``attachment_shas`` list lives in ``call_attachments``); indexed on ``(rollout_id, seq)``.
  Format 4 added the columns of record schema 2 (NULL in rows written before).
* ``blobs``: content-addressed messages and request bodies (key = sha256 of the bytes; since
  format 2 stored zlib-compressed when that is smaller, ``codec`` says which).
* ``attachments``: content-addressed image bytes, stored once per store; ``call_attachments``
  lists which call refers to which, in order of first reference, and (since format 6) under
  which media type: two calls may send the same bytes as ``image/png`` and ``image/jpeg``, and
  each record's digest binds its own.
* ``rollouts``, ``failures``, ``orphaned``: each rollout's ledger.

Since format 3 the file refuses a second call at one ``(rollout_id, seq)`` (staged or in the
ledger; a call's own record and ledger entry may share it): triggers on ``calls`` and ``failures``.

Since format 5, ``events`` holds each rollout's hash-chained event log (`schemas.events`), one
row per event keyed by ``(rollout_id, position)``; admission claims are its ``claim`` rows,
unique per ``(rollout_id, seq)`` (a partial unique index).

Since format 7, ``rollouts`` keeps the rollout index (`sinks.rollout_index`): ``group_id`` and
``graded`` (its latest outcome's group, and whether it has an outcome) as columns, indexed with
``(state, sealed_at_ms)``; and ``consumers`` holds each trainer's batch cursor
(`capture_proxy.read.batches`), one row per consumer name.

The format version is an integer with a chain of migrations (``MIGRATIONS[i]`` turns format ``i``
into ``i + 1``; format 0 is an empty file). A writer migrates an older file forward in one
transaction; a file written by a newer capture-proxy is refused, never guessed at.
"""

from __future__ import annotations

import sqlite3
import sys
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

import orjson

from ...schemas.outcome import split_header_metadata
from ..base import StoreError, StoreFormatError
from ..codec import ROW_FIELDS, stored_bytes, stored_int

__all__ = [
    "CALL_COLUMNS",
    "CALL_COLUMNS_3",
    "DUPLICATE_SEQ",
    "FORMAT_VERSION",
    "MIGRATIONS",
    "READABLE_FROM",
    "TokenLRU",
    "call_columns",
    "has_events",
    "has_index",
    "has_reference_types",
    "outcome_columns",
    "pack_blob",
    "read_format",
    "rebuild_full",
    "unpack_blob",
    "upgrade",
]

APPLICATION = "capture-proxy"

#: The codec row columns stored in ``calls``; ``attachment_shas`` and ``attachment_media_types``
#: are normalized into ``call_attachments`` (one row per reference, with its order and media
#: type), so they are not columns.
CALL_COLUMNS = tuple(
    f for f in ROW_FIELDS if f not in ("attachment_shas", "attachment_media_types")
)

_CALL_TYPES = {
    "call_id": "TEXT PRIMARY KEY",
    "rollout_id": "TEXT NOT NULL",
    "seq": "INTEGER NOT NULL",
    "parent_call_id": "TEXT",
    "retry_of": "TEXT",
    "created_at_ms": "INTEGER NOT NULL",
    "weight_version": "INTEGER NOT NULL",
    "model": "TEXT NOT NULL",
    "upstream_version": "TEXT NOT NULL",
    "tokenizer_fingerprint": "TEXT NOT NULL",
    "finish_reason": "TEXT NOT NULL",
    "schema_version": "INTEGER NOT NULL",
    "sampling": "BLOB NOT NULL",
    "response": "BLOB NOT NULL",
    "extras": "BLOB NOT NULL",
    "request_key": "TEXT NOT NULL",
    "message_keys": "BLOB NOT NULL",
    "prompt_len": "INTEGER NOT NULL",
    "prev_len": "INTEGER NOT NULL",
    "delta_len": "INTEGER NOT NULL",
    "cum_len": "INTEGER NOT NULL",
    "delta_tokens": "BLOB NOT NULL",
    "completion_logprobs": "BLOB NOT NULL",
    "digest": "TEXT NOT NULL",
    "extras_digest": "TEXT NOT NULL",
}
#: Added by format 4 (record schema 2). Nullable and without defaults: rows written before read
#: NULL, which the codec decodes as a version-1 record's defaults.
_CALL_TYPES_4 = {
    "engine_weight_version": "TEXT",
    "weight_spans": "BLOB",
    "token_in": "INTEGER",
    "bridge_spans": "BLOB",
    "replica": "TEXT",
    "effective_sampling": "BLOB",
    "logprobs_mode": "TEXT",
}
#: The columns a file of format 2 or 3 has (a reader takes those files as they are).
CALL_COLUMNS_3 = tuple(_CALL_TYPES)
# A codec change that adds a column must come with a migration; fail at import, not at write.
assert (*_CALL_TYPES, *_CALL_TYPES_4) == CALL_COLUMNS, "calls out of step with codec.ROW_FIELDS"


def _migrate_0_to_1(conn: sqlite3.Connection) -> None:
    # Format 1's columns only: later formats add theirs in their own step.
    calls = ",\n  ".join(f"{name} {decl}" for name, decl in _CALL_TYPES.items())
    statements = [
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        f"CREATE TABLE calls (\n  {calls}\n)",
        "CREATE INDEX calls_rollout_seq ON calls (rollout_id, seq)",
        "CREATE TABLE blobs (key TEXT PRIMARY KEY, data BLOB NOT NULL)",
        "CREATE TABLE attachments (sha256 TEXT PRIMARY KEY, media_type TEXT NOT NULL,"
        " size INTEGER NOT NULL, data BLOB NOT NULL)",
        "CREATE TABLE call_attachments (call_id TEXT NOT NULL, sha256 TEXT NOT NULL,"
        " ord INTEGER NOT NULL, PRIMARY KEY (call_id, ord))",
        "CREATE INDEX call_attachments_sha ON call_attachments (sha256)",
        "CREATE TABLE rollouts (id TEXT PRIMARY KEY, state TEXT NOT NULL,"
        " created_at_ms INTEGER NOT NULL, sealed_at_ms INTEGER, metadata TEXT NOT NULL,"
        " policy TEXT NOT NULL)",
        "CREATE TABLE failures (rollout_id TEXT NOT NULL, call_id TEXT NOT NULL,"
        " seq INTEGER NOT NULL, status TEXT NOT NULL, reason TEXT NOT NULL,"
        " message TEXT NOT NULL, http_status INTEGER, at_ms INTEGER NOT NULL)",
        "CREATE INDEX failures_rollout_seq ON failures (rollout_id, seq)",
        "CREATE TABLE orphaned (call_id TEXT PRIMARY KEY, reason TEXT NOT NULL,"
        " at_ms INTEGER NOT NULL)",
    ]
    for sql in statements:
        conn.execute(sql)
    conn.execute("INSERT INTO meta (key, value) VALUES ('application', ?)", (APPLICATION,))
    conn.execute("INSERT INTO meta (key, value) VALUES ('format_version', '0')")


def _migrate_1_to_2(conn: sqlite3.Connection) -> None:
    # Format 2: message and request blobs may be zlib-compressed (codec 1). Their key stays the
    # sha256 of the uncompressed bytes, so content addressing and digests are unchanged; blobs
    # written by format 1 keep codec 0 (stored as is).
    conn.execute("ALTER TABLE blobs ADD COLUMN codec INTEGER NOT NULL DEFAULT 0")


#: What the store's triggers raise for a second call at one ``(rollout_id, seq)``.
DUPLICATE_SEQ = "duplicate_seq"


def _migrate_2_to_3(conn: sqlite3.Connection) -> None:
    # Format 3: one call per (rollout_id, seq), over staged records and the ledger together. A
    # record and a ledger entry of the *same* call may share their seq: a write that landed after
    # its caller gave up is staged (then marked orphaned) and also in the ledger as
    # capture_failed. Triggers rather than a unique index: an index cannot be built over a file
    # that already holds duplicates (written before this rule), and such a file must still open;
    # `Store.verify` reports what it holds. Both lookups use the (rollout_id, seq) indexes.
    conn.execute(
        "CREATE TRIGGER calls_one_per_seq BEFORE INSERT ON calls WHEN EXISTS ("
        "SELECT 1 FROM calls WHERE rollout_id = NEW.rollout_id AND seq = NEW.seq"
        ") OR EXISTS ("
        "SELECT 1 FROM failures WHERE rollout_id = NEW.rollout_id AND seq = NEW.seq"
        " AND call_id != NEW.call_id"
        f") BEGIN SELECT RAISE(ABORT, '{DUPLICATE_SEQ}'); END"
    )
    conn.execute(
        "CREATE TRIGGER failures_one_per_seq BEFORE INSERT ON failures WHEN EXISTS ("
        "SELECT 1 FROM calls WHERE rollout_id = NEW.rollout_id AND seq = NEW.seq"
        " AND call_id != NEW.call_id"
        ") OR EXISTS ("
        "SELECT 1 FROM failures WHERE rollout_id = NEW.rollout_id AND seq = NEW.seq"
        " AND call_id != NEW.call_id"
        f") BEGIN SELECT RAISE(ABORT, '{DUPLICATE_SEQ}'); END"
    )


def _migrate_3_to_4(conn: sqlite3.Connection) -> None:
    # Format 4: the columns of record schema 2 (`codec.V2_ROW_FIELDS`). Rows already stored keep
    # NULL there and stay version-1 records, verified with the digest they were sealed with.
    for name, decl in _CALL_TYPES_4.items():
        conn.execute(f"ALTER TABLE calls ADD COLUMN {name} {decl}")


def _migrate_4_to_5(conn: sqlite3.Connection) -> None:
    # Format 5: the per-rollout event log. `body` is the event's JSON body; `hash` chains each
    # event to the one before (`prev_hash`). A unique index (not a trigger) for claims: the table
    # is new, so no file can already hold two claims of one seq. Rollouts staged before keep no
    # events: nothing to account for, and `verify` checks only what a chain holds.
    conn.execute(
        "CREATE TABLE events (rollout_id TEXT NOT NULL, position INTEGER NOT NULL,"
        " kind TEXT NOT NULL, seq INTEGER, call_id TEXT, at_ms INTEGER NOT NULL,"
        " body TEXT NOT NULL, prev_hash TEXT NOT NULL, hash TEXT NOT NULL,"
        " PRIMARY KEY (rollout_id, position))"
    )
    conn.execute(
        "CREATE UNIQUE INDEX events_one_claim_per_seq ON events (rollout_id, seq)"
        " WHERE kind = 'claim'"
    )


def _migrate_5_to_6(conn: sqlite3.Connection) -> None:
    # Format 6: each reference keeps its own media type (the bytes stay stored once). Until now
    # every reference read with the one media type stored with the bytes, so that is what the
    # references already stored take. Nullable: a writer that was not told a reference's media
    # type stores NULL, and a reader falls back to the bytes' own.
    conn.execute("ALTER TABLE call_attachments ADD COLUMN media_type TEXT")
    conn.execute(
        "UPDATE call_attachments SET media_type ="
        " (SELECT a.media_type FROM attachments a WHERE a.sha256 = call_attachments.sha256)"
    )


def outcome_columns(metadata: str | bytes) -> tuple[str | None, int]:
    """A header's stored metadata as the index columns ``(group_id, graded)``: its latest
    outcome's group and whether it has an outcome."""
    _, outcomes = split_header_metadata(orjson.loads(metadata or b"{}"))
    if not outcomes:
        return None, 0
    return outcomes[-1].group_id, 1


def _migrate_6_to_7(conn: sqlite3.Connection) -> None:
    # Format 7: the rollout index and the consumers' cursors. The group and grading of a header
    # live inside its metadata JSON; as columns they can be indexed, so a trainer's "sealed,
    # graded, group g" costs what it returns. Headers already stored are filled from their
    # metadata here, once.
    conn.execute("ALTER TABLE rollouts ADD COLUMN group_id TEXT")
    conn.execute("ALTER TABLE rollouts ADD COLUMN graded INTEGER NOT NULL DEFAULT 0")
    for rollout_id, metadata in conn.execute("SELECT id, metadata FROM rollouts").fetchall():
        group_id, graded = outcome_columns(metadata)
        if graded:
            conn.execute(
                "UPDATE rollouts SET group_id = ?, graded = 1 WHERE id = ?", (group_id, rollout_id)
            )
    conn.execute("CREATE INDEX rollouts_state_sealed ON rollouts (state, sealed_at_ms)")
    conn.execute("CREATE INDEX rollouts_group ON rollouts (group_id) WHERE group_id IS NOT NULL")
    conn.execute(
        "CREATE TABLE consumers (name TEXT PRIMARY KEY, body BLOB NOT NULL,"
        " revision INTEGER NOT NULL, at_ms INTEGER NOT NULL)"
    )


#: ``MIGRATIONS[i]`` upgrades format ``i`` to ``i + 1``. Append; never edit a shipped step.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _migrate_0_to_1,
    _migrate_1_to_2,
    _migrate_2_to_3,
    _migrate_3_to_4,
    _migrate_4_to_5,
    _migrate_5_to_6,
    _migrate_6_to_7,
)

#: Blob codecs (the ``blobs.codec`` column).
BLOB_RAW, BLOB_ZLIB = 0, 1
#: Blobs shorter than this are stored as they are: compression would not pay for itself.
_COMPRESS_FROM = 256


def pack_blob(data: bytes) -> tuple[bytes, int]:
    """The stored form of a blob: zlib (level 1: cheap, ~3x on chat JSON) when it is smaller."""
    if len(data) >= _COMPRESS_FROM:
        packed = zlib.compress(data, 1)
        if len(packed) < len(data):
            return packed, BLOB_ZLIB
    return data, BLOB_RAW


#: The most a stored blob (one message, or a request without its messages) may decompress to:
#: twice the proxy's default request body limit (``--max-body-bytes``, 64 MiB), and a blob is a
#: part of one request body. A crafted one (a "zlib bomb": 2 MB that inflate to 2 GiB) is
#: refused after this many bytes instead of taking the reader's memory.
MAX_BLOB_BYTES = 128 << 20


def unpack_blob(key: str, data: bytes, codec: int) -> bytes:
    """A stored blob's bytes; ValueError for a damaged one, an unknown codec, or one that
    decompresses past `MAX_BLOB_BYTES`."""
    if codec == BLOB_RAW:
        return data
    if codec == BLOB_ZLIB:
        inflate = zlib.decompressobj()
        try:
            out = inflate.decompress(data, MAX_BLOB_BYTES + 1)
        except zlib.error as e:
            raise ValueError(f"blob {key} is damaged: {e}") from e
        if len(out) > MAX_BLOB_BYTES:
            raise ValueError(
                f"blob {key} decompresses past {MAX_BLOB_BYTES} bytes (MAX_BLOB_BYTES): no "
                "writer stores one that large; refused unread"
            )
        if not inflate.eof:
            raise ValueError(f"blob {key} is damaged: its compressed stream is cut short")
        return out
    raise ValueError(f"blob {key} has an unknown codec {codec!r}")


FORMAT_VERSION = len(MIGRATIONS)
#: The oldest format a reader takes as it is: format 3 added write rules only (triggers), so a
#: format-2 file reads the same (and `verify` can report the duplicates it may hold); format 4
#: added columns that a reader of an older file reads as their defaults (`call_columns`);
#: format 5 added the events table, which an older file reads as empty (`has_events`); format 6
#: the references' media types, which an older file reads as its bytes' (`has_reference_types`).
READABLE_FROM = 2


def call_columns(version: int) -> tuple[str, ...]:
    """The `calls` columns a file of format `version` has (a reader selects only those)."""
    return CALL_COLUMNS if version >= 4 else CALL_COLUMNS_3


def has_events(version: int) -> bool:
    """Whether a file of format `version` has the event log (format 5 and later)."""
    return version >= 5


def has_reference_types(version: int) -> bool:
    """Whether a file of format `version` keeps each attachment reference's media type (6+)."""
    return version >= 6


def has_index(version: int) -> bool:
    """Whether a file of format `version` has the rollout index and consumers' cursors (7+)."""
    return version >= 7


def read_format(conn: sqlite3.Connection, where: str) -> int:
    """The file's format version (0 for an empty file); refuses files that are not ours.

    Raises `StoreFormatError` for a file written by a newer capture-proxy and `StoreError` for a
    SQLite file that is not a capture-proxy store (or not SQLite at all).
    """
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            return 0
        if "meta" not in tables:
            raise StoreError(f"{where} is a SQLite file but not a capture-proxy store")
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{where} is not a capture-proxy store: {e}") from e
    if meta.get("application") != APPLICATION:
        raise StoreError(f"{where} is a SQLite file but not a capture-proxy store")
    try:
        version = int(meta["format_version"])
    except (KeyError, ValueError) as e:
        raise StoreError(f"{where}: its format_version is missing or not an integer") from e
    if version > FORMAT_VERSION:
        raise StoreFormatError(
            f"{where} was written by a newer capture-proxy "
            f"(format {version} > {FORMAT_VERSION}): upgrade capture-proxy to read it"
        )
    return version


def upgrade(conn: sqlite3.Connection, where: str) -> None:
    """Bring the file to `FORMAT_VERSION` in one transaction (creating it when empty).

    `conn` must be in autocommit mode (``isolation_level=None``).
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        # Read the version inside the write lock: two processes opening a new file at once
        # must not both run the migrations.
        version = read_format(conn, where)
        for step in MIGRATIONS[version:]:
            step(conn)
        if version < FORMAT_VERSION:
            conn.execute(
                "UPDATE meta SET value = ? WHERE key = 'format_version'", (str(FORMAT_VERSION),)
            )
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _tokens(data: bytes) -> array[int]:
    # The codec stores token ids as little-endian int32 whatever the host's byte order.
    ids = array("i")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


class TokenLRU:
    """Recently used full sequences (call id -> rollout id, prompt + completion), LRU-evicted
    once they hold more than `max_tokens` tokens in total."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._items: OrderedDict[str, tuple[str, array[int]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, call_id: str) -> tuple[str, array[int]] | None:
        item = self._items.get(call_id)
        if item is not None:
            self._items.move_to_end(call_id)
        return item

    def put(self, call_id: str, rollout_id: str, full: array[int]) -> None:
        old = self._items.pop(call_id, None)
        if old is not None:
            self.tokens -= len(old[1])
        self._items[call_id] = (rollout_id, full)
        self.tokens += len(full)
        while self.tokens > self.max_tokens and self._items:
            _, (_, evicted) = self._items.popitem(last=False)
            self.tokens -= len(evicted)


def rebuild_full(
    conn: sqlite3.Connection, call_id: str, cache: TokenLRU | None = None
) -> array[int] | None:
    """The stored call's prompt + completion, rebuilt through its parent chain (None if absent).

    Walks up iteratively (no recursion limit for long sessions) until a call that stores its
    whole sequence (prev_len 0) or one found in `cache`, then replays the deltas downward in one
    array (truncate to the shared prefix, append the delta: no copy per generation), and adds the
    result to `cache`. Raises `ValueError` for a chain that does not add up (a cycle, a missing
    ancestor, lengths that disagree): only a damaged file holds one.
    """
    chain: list[tuple[str, int, bytes, int]] = []
    seen: set[str] = set()
    base: array[int] | None = None
    rollout_id = ""
    key: str | None = call_id
    while key is not None:
        hit = cache.get(key) if cache is not None else None
        if hit is not None:
            base = hit[1]
            break
        if key in seen:
            raise ValueError(f"{call_id}: the parent chain loops at {key}")
        seen.add(key)
        row = conn.execute(
            "SELECT rollout_id, parent_call_id, prev_len, delta_tokens, cum_len"
            " FROM calls WHERE call_id = ?",
            (key,),
        ).fetchone()
        if row is None:
            if key == call_id:
                return None
            raise ValueError(f"{call_id}: ancestor {key} is missing from the store")
        rollout, parent, prev_len, delta, cum_len = row
        if key == call_id:
            rollout_id = rollout
        chain.append(
            (
                key,
                stored_int(prev_len, "prev_len"),
                stored_bytes(delta, "delta_tokens"),
                stored_int(cum_len, "cum_len"),
            )
        )
        key = parent if prev_len else None
    if not chain:
        return base
    seq = array("i", base) if base is not None else array("i")  # a copy: cached arrays stay as is
    for key, prev_len, delta, cum_len in reversed(chain):
        if len(seq) < prev_len:
            raise ValueError(f"{call_id}: ancestor {key} needs {prev_len} tokens of its parent")
        del seq[prev_len:]
        seq.extend(_tokens(delta))
        if len(seq) != cum_len:
            raise ValueError(f"{key}: rebuilt {len(seq)} tokens, the row says {cum_len}")
    if cache is not None:
        cache.put(call_id, rollout_id, seq)
    return seq
