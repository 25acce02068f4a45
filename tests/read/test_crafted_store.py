"""A store file from someone else fails cleanly: a zlib bomb is refused at a named limit, a value
of the wrong type is a verify problem (never a traceback), and escape sequences in ids reach the
terminal as visible text. bench/fuzz_crafted_store.py runs a thousand such edits."""

from __future__ import annotations

import io
import sqlite3
import zlib
from contextlib import redirect_stderr
from pathlib import Path

import orjson
import pytest

from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.inspect.escape import escape_json, escape_text
from capture_proxy.read.reader import RolloutExcluded, StoreCorrupted, open_store
from capture_proxy.sinks.base import StoreDamaged
from capture_proxy.sinks.sqlite._schema import MAX_BLOB_BYTES, unpack_blob
from tests.read.test_tamper import Rows, _rows, write

ANSI = "\x1b[2J\x1b]0;owned\x07"


def _bomb(size: int) -> bytes:
    z = zlib.compressobj(9)
    chunk = bytes(1 << 24)
    return b"".join(z.compress(chunk) for _ in range(size >> 24)) + z.flush()


def test_a_zlib_bomb_is_refused_at_the_named_limit() -> None:
    bomb = _bomb(MAX_BLOB_BYTES * 2)
    assert len(bomb) < MAX_BLOB_BYTES // 500
    with pytest.raises(ValueError, match=r"decompresses past 134217728 bytes \(MAX_BLOB_BYTES\)"):
        unpack_blob("k", bomb, 1)
    with pytest.raises(ValueError, match="cut short"):
        unpack_blob("k", zlib.compress(b"x" * 1000)[:-4], 1)
    assert unpack_blob("k", zlib.compress(b"ok" * 500), 1) == b"ok" * 500


async def test_a_bomb_in_a_store_is_a_verify_problem_and_a_clean_error(tmp_path: Path) -> None:
    w = await write("sqlite", tmp_path)
    with sqlite3.connect(w.where) as db:
        db.execute("UPDATE blobs SET data = ?, codec = 1 WHERE rowid = 1", (_bomb(1 << 30),))
    db.close()
    with open_store(w.url) as store:
        with pytest.raises(StoreCorrupted, match="MAX_BLOB_BYTES"):
            store.verify()
        skipped: dict[str, list[str]] = {}
        list(store.iter_trajectories(skipped=skipped))
        assert skipped["unverified"]
    out = io.StringIO()
    assert inspect_main([w.url, "--verify"], stdout=out) == 1
    assert "MAX_BLOB_BYTES" in out.getvalue()


@pytest.mark.parametrize(
    ("table", "column", "value"),
    [
        ("calls", "seq", "one"),
        ("calls", "seq", 1.5),
        ("failures", "seq", "[1, 2"),
        ("events", "seq", "x"),
        ("events", "body", "{not json"),
        ("calls", "delta_tokens", 2**40),
        ("rollouts", "created_at_ms", b"\x00\xff"),
        ("rollouts", "metadata", "[]"),
    ],
)
async def test_a_value_of_the_wrong_type_is_a_verify_problem_not_a_traceback(
    tmp_path: Path, table: str, column: str, value: object
) -> None:
    w = await write("sqlite", tmp_path, poisoned=True)
    with sqlite3.connect(w.where) as db:
        where = "rollout_id = 'ep'" if table != "rollouts" else "id = 'ep'"
        first = f"(SELECT min(rowid) FROM {table} WHERE {where})"
        db.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = {first}", (value,))
    db.close()
    with open_store(w.url) as store:
        with pytest.raises(StoreCorrupted) as e:
            store.verify()
        assert any(p.key in ("rollout:ep", w.records[0].call_id) for p in e.value.problems)
        with pytest.raises((StoreDamaged, RolloutExcluded)):
            store.trajectory("ep", include_poisoned=True)
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err):
        assert inspect_main([w.url, "--verify"], stdout=out) in (1, 2)
    assert "Traceback" not in err.getvalue() + out.getvalue()


async def test_escape_sequences_in_rollout_ids_reach_the_terminal_as_text(tmp_path: Path) -> None:
    w = await write("sqlite", tmp_path)
    evil = f"ep{ANSI}\x9b31m\u202e"
    with sqlite3.connect(w.where) as db:
        for table, column in (
            ("rollouts", "id"),
            ("calls", "rollout_id"),
            ("events", "rollout_id"),
        ):
            db.execute(f"UPDATE {table} SET {column} = ? WHERE {column} = 'ep'", (evil,))
    db.close()
    for argv in ([w.url], [w.url, "--verify"], [w.url, "--rollout", evil], [w.url, "--json"]):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stderr(err):
            inspect_main(argv, stdout=out)
        shown = out.getvalue() + err.getvalue()
        assert "\x1b" not in shown
        assert "\x9b" not in shown
        assert "\u202e" not in shown
        assert "ep" in shown
    out = io.StringIO()
    inspect_main([w.url, "--json"], stdout=out)
    ids = [r["rollout_id"] for r in orjson.loads(out.getvalue())["rollouts"]]
    assert evil in ids  # the JSON value is the same: only its spelling escapes


def test_escaping_keeps_text_and_shows_controls() -> None:
    assert escape_text("naïve 日本 ok") == "naïve 日本 ok"
    assert escape_text("a\x1b[31mb\x07") == "a\\x1b[31mb\\x07"
    assert escape_text("a\nb\tc", keep_layout=True) == "a\nb\tc"
    assert escape_text("a\nb") == "a\\x0ab"
    assert escape_text("\u202eabc") == "\\u202eabc"
    assert orjson.loads(escape_json(orjson.dumps({"k": "\x9b\x7f\u2066"}).decode())) == {
        "k": "\x9b\x7f\u2066"
    }


@pytest.mark.parametrize(
    ("table", "column", "value"),
    [
        ("ledger", "body", b"[1, 2]"),
        ("ledger", "body", b"{not json"),
        ("ledger", "metadata", b"\xff\xfe"),
        ("calls", "delta_tokens", b"\x01\x02\x03"),
        ("calls", "sampling", b"[]"),
    ],
)
async def test_a_crafted_parquet_value_is_a_verify_problem_not_a_traceback(
    tmp_path: Path, table: str, column: str, value: bytes
) -> None:
    w = await write("parquet", tmp_path)

    def edit(rows: Rows) -> Rows:
        for r in rows:
            if r["rollout_id"] == "ep" and r.get(column) is not None:
                r[column] = value
                break
        return rows

    _rows(w, table, edit)
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err):
        code = inspect_main([w.url, "--verify"], stdout=out)
    assert code in (1, 2)
    assert "Traceback" not in err.getvalue() + out.getvalue()
    with open_store(w.url) as store:
        try:
            skipped: dict[str, list[str]] = {}
            took = [t.rollout_id for t in store.iter_trajectories(skipped=skipped)]
        except StoreDamaged:
            return  # the whole store's index cannot be read: a clean error
        assert "ep" not in took
