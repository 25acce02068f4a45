"""Format 1 -> 2 (compressed blobs): an older store migrates on open and reads back the same."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from capture_proxy.read.reader import Store
from capture_proxy.sinks.base import StoreFormatError
from capture_proxy.sinks.codec import encode_record
from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource
from capture_proxy.sinks.sqlite._schema import CALL_COLUMNS_3, FORMAT_VERSION, MIGRATIONS
from tests.support.sink_factories import Session


def _format_1_store(path: Path) -> list[str]:
    """A store as format 1 wrote it: uncompressed blobs, no codec column."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    MIGRATIONS[0](conn)
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'format_version'")
    keys = []
    parent = None
    session = Session("r1", seed=3, schema_version=1)
    for _ in range(3):
        record, _atts = session.next(new_prompt=400)
        enc = encode_record(record, parent)
        conn.executemany("INSERT OR IGNORE INTO blobs (key, data) VALUES (?, ?)", enc.blobs.items())
        marks = ",".join("?" * len(CALL_COLUMNS_3))
        conn.execute(
            f"INSERT INTO calls ({', '.join(CALL_COLUMNS_3)}) VALUES ({marks})",
            [enc.row[c] for c in CALL_COLUMNS_3],
        )
        conn.execute("INSERT OR IGNORE INTO rollouts VALUES ('r1', 'open', 0, NULL, '{}', '{}')")
        parent = enc.full
        keys.append(record.call_id)
    conn.execute("COMMIT")
    conn.close()
    return keys


async def test_format_1_store_is_refused_for_reading_then_migrated_by_a_writer(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    keys = _format_1_store(path)
    with pytest.raises(StoreFormatError, match="open it once for writing"):
        SQLiteSource(str(path))
    sink = SQLiteSink(str(path))
    await sink.close()
    with Store(SQLiteSource(str(path))) as store:
        records = store.fetch(keys)  # old uncompressed blobs still read and verify
        store.verify()
    assert [r.call_id for r in records] == keys
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone() == (
            str(FORMAT_VERSION),
        )
        assert {c for (c,) in conn.execute("SELECT DISTINCT codec FROM blobs")} == {0}


async def test_new_blobs_are_compressed_when_that_is_smaller(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    sink = SQLiteSink(str(path))
    session = Session("r1", seed=1)
    session.messages.append({"role": "user", "content": "repetitive context line\n" * 200})
    record, _ = session.next()
    assert (await sink.stage(record)).status == "staged"
    await sink.close()
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT codec, length(data) FROM blobs").fetchall()
    assert (1, min(n for c, n in rows if c == 1)) in rows  # the long message went in zlib'd
    assert any(c == 0 for c, _ in rows)  # short blobs stay as they are
    with Store(SQLiteSource(str(path))) as store:
        (back,) = store.fetch([record.call_id])
    assert back.request == record.request


async def test_format_5_references_take_their_bytes_media_type_when_migrated(
    tmp_path: Path,
) -> None:
    """Format 6 keeps each reference's media type: the references a format-5 file holds are
    given the media type stored with their bytes (what they read with before)."""
    from tests.support.sink_factories import SQLiteCase, image

    case = SQLiteCase(tmp_path)
    session = Session("r5", image=image("r5"))
    for _ in range(2):
        record, atts = session.next()
        assert (await case.sink.stage(record, attachments=atts)).status == "staged"
    await case.sink.close()
    case.drop_reference_media_types()
    await SQLiteSink(str(case.path)).close()  # a writer opens it: format 5 -> 6
    with sqlite3.connect(case.path) as conn:
        rows = conn.execute("SELECT call_id, media_type FROM call_attachments").fetchall()
        (version,) = conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()
    assert sorted(rows) == [("r5-c0", "image/png"), ("r5-c1", "image/png")]
    assert version == str(FORMAT_VERSION) == "7"
    with Store(SQLiteSource(str(case.path))) as store:
        store.verify()
