"""Retention for SQLite stores: remove whole sealed rollouts older than a cutoff.

Only sealed rollouts go, and only whole: a trainer never finds half an episode. The proxy may keep
writing meanwhile; each step holds the write lock briefly:

1. one ``BEGIN IMMEDIATE`` transaction deletes the rollouts' calls, attachment references,
   ledger entries and headers (indexed deletes);
2. blobs and attachments no remaining call refers to are found from a read snapshot (no lock),
   then deleted in a second short transaction that first re-checks the calls written since the
   snapshot, so a blob a new call shares (the same system prompt) is never removed.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path

from ..base import GcStats, Progress, StoreError
from ._schema import has_events, read_format

# GcStats lives in `base` (shared with `parquet._gc`); still importable from here.
__all__ = ["GcStats", "gc_sqlite"]


def _chunks(items: list[str], n: int = 500) -> Iterable[list[str]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _referenced_blobs(conn: sqlite3.Connection, since_rowid: int = 0) -> set[str]:
    refs: set[str] = set()
    rows = conn.execute(
        "SELECT request_key, message_keys FROM calls WHERE rowid > ?", (since_rowid,)
    )
    for request_key, keys in rows:
        refs.add(request_key)
        raw = bytes(keys)
        refs.update(raw[i : i + 32].hex() for i in range(0, len(raw), 32))
    return refs


def gc_sqlite(
    path: str,
    *,
    older_than_ms: int,
    now_ms: int,
    dry_run: bool = False,
    vacuum: bool = False,
    progress: Progress | None = None,
) -> GcStats:
    """Remove sealed rollouts sealed before ``now_ms - older_than_ms``.

    Freed pages are reused by later writes; `vacuum` also shrinks the file, but holds an
    exclusive lock while it copies the store: run it with the proxy stopped.
    """
    if not Path(path).is_file():
        raise StoreError(f"no SQLite store at {path}")
    size_before = Path(path).stat().st_size
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        version = read_format(conn, path)
        conn.execute("PRAGMA busy_timeout = 10000")
        cutoff = now_ms - older_than_ms
        ids = [
            r[0]
            for r in conn.execute(
                "SELECT id FROM rollouts WHERE state = 'sealed' AND sealed_at_ms IS NOT NULL"
                " AND sealed_at_ms < ? ORDER BY sealed_at_ms",
                (cutoff,),
            )
        ]
        calls = 0
        for chunk in _chunks(ids):
            marks = ",".join("?" * len(chunk))
            calls += conn.execute(
                f"SELECT count(*) FROM calls WHERE rollout_id IN ({marks})", chunk
            ).fetchone()[0]
        if dry_run or not ids:
            return GcStats(ids, calls, 0, 0, size_before, size_before)
        # Steps: each chunk of rollouts deleted, the unreferenced blobs, the vacuum if asked.
        chunks = list(_chunks(ids))
        steps = len(chunks) + 1 + int(vacuum)
        conn.execute("BEGIN IMMEDIATE")
        try:
            for done, chunk in enumerate(chunks, 1):
                marks = ",".join("?" * len(chunk))
                conn.execute(
                    "DELETE FROM call_attachments WHERE call_id IN"
                    f" (SELECT call_id FROM calls WHERE rollout_id IN ({marks}))",
                    chunk,
                )
                conn.execute(
                    "DELETE FROM orphaned WHERE call_id IN"
                    f" (SELECT call_id FROM calls WHERE rollout_id IN ({marks}))",
                    chunk,
                )
                conn.execute(f"DELETE FROM calls WHERE rollout_id IN ({marks})", chunk)
                conn.execute(f"DELETE FROM failures WHERE rollout_id IN ({marks})", chunk)
                conn.execute(f"DELETE FROM rollouts WHERE id IN ({marks})", chunk)
                if has_events(version):  # their claims too: the ids may be used again
                    conn.execute(f"DELETE FROM events WHERE rollout_id IN ({marks})", chunk)
                if progress is not None:
                    progress(done, steps)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        blobs, attachments = _collect_unreferenced(conn)
        if progress is not None:
            progress(len(chunks) + 1, steps)
        if vacuum:
            conn.execute("VACUUM")
            if progress is not None:
                progress(steps, steps)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return GcStats(ids, calls, blobs, attachments, size_before, Path(path).stat().st_size)


def _collect_unreferenced(conn: sqlite3.Connection) -> tuple[int, int]:
    # Step 2: candidates from a snapshot without the write lock...
    conn.execute("BEGIN")
    snapshot_rowid = conn.execute("SELECT coalesce(max(rowid), 0) FROM calls").fetchone()[0]
    referenced = _referenced_blobs(conn)
    blob_candidates = {k for (k,) in conn.execute("SELECT key FROM blobs")} - referenced
    att_candidates = {
        s
        for (s,) in conn.execute(
            "SELECT sha256 FROM attachments WHERE sha256 NOT IN"
            " (SELECT sha256 FROM call_attachments)"
        )
    }
    conn.execute("COMMIT")
    if not blob_candidates and not att_candidates:
        return 0, 0
    # ...then, holding the lock, spare whatever calls written since the snapshot refer to.
    conn.execute("BEGIN IMMEDIATE")
    try:
        blob_candidates -= _referenced_blobs(conn, snapshot_rowid)
        att_candidates -= {
            s for (s,) in conn.execute("SELECT DISTINCT sha256 FROM call_attachments")
        }
        blobs = sorted(blob_candidates)
        atts = sorted(att_candidates)
        for chunk in _chunks(blobs):
            conn.execute(f"DELETE FROM blobs WHERE key IN ({','.join('?' * len(chunk))})", chunk)
        for chunk in _chunks(atts):
            conn.execute(
                f"DELETE FROM attachments WHERE sha256 IN ({','.join('?' * len(chunk))})", chunk
            )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return len(blobs), len(atts)
