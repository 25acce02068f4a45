"""Consumers' cursors in a SQLite store: the ``consumers`` table (format 7)."""

from __future__ import annotations

import sqlite3
import threading
import time
import urllib.parse

from ..base import StoreError, StoreFormatError
from ..cursors import CursorConflict
from ._schema import has_index, read_format

__all__ = ["SQLiteCursors"]


class SQLiteCursors:
    """`CursorStorage` over the ``consumers`` table, through a connection of its own.

    The store's reader is read-only; this writes one row per save, in a short transaction beside
    the proxy's writer (SQLite serializes them: WAL, a busy timeout). A file older than format 7
    has no table: opening it once for writing (a proxy, `capture-proxy migrate`) adds it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            uri = "file:" + urllib.parse.quote(self.path) + "?mode=rw"
            try:
                conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
                conn.execute("PRAGMA busy_timeout = 10000")
                version = read_format(conn, self.path)
            except sqlite3.Error as e:
                raise StoreError(f"cannot write consumer cursors in {self.path}: {e}") from e
            if not has_index(version):
                conn.close()
                raise StoreFormatError(
                    f"{self.path} has the older format {version}, without consumer cursors: "
                    "open it once for writing (a proxy on it) to migrate it"
                )
            self._conn = conn
        return self._conn

    def load(self, name: str) -> tuple[bytes, int] | None:
        with self._lock:
            row = (
                self._connect()
                .execute("SELECT body, revision FROM consumers WHERE name = ?", (name,))
                .fetchone()
            )
        return None if row is None else (bytes(row[0]), int(row[1]))

    def save(self, name: str, body: bytes, revision: int) -> int:
        with self._lock:
            conn = self._connect()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    row = conn.execute(
                        "SELECT revision FROM consumers WHERE name = ?", (name,)
                    ).fetchone()
                    stored = 0 if row is None else int(row[0])
                    if stored != revision:
                        raise CursorConflict(
                            f"consumer {name!r}: its cursor is at revision {stored}, not "
                            f"{revision}: another process takes batches under this name"
                        )
                    conn.execute(
                        "INSERT INTO consumers (name, body, revision, at_ms) VALUES (?, ?, ?, ?)"
                        " ON CONFLICT (name) DO UPDATE SET body = excluded.body,"
                        " revision = excluded.revision, at_ms = excluded.at_ms",
                        (name, body, revision + 1, int(time.time() * 1000)),
                    )
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise StoreError(
                    f"cannot save consumer {name!r}'s cursor in {self.path}: {e}"
                ) from e
        return revision + 1

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
