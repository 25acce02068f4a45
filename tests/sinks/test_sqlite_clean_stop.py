"""A clean stop leaves one self-contained SQLite file: a user who copies only `capture.db` after
stopping the proxy copies every record (nothing left behind in `-wal`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

from capture_proxy import open_store
from tests.support.reliability_workers import start_proxy


def test_a_clean_stop_leaves_every_record_in_the_db_file(tmp_path: Path) -> None:
    db = tmp_path / "capture.db"
    proxy = start_proxy("fake", f"sqlite:///{db}")
    try:
        base = proxy.wait_ready()
        for i in range(3):
            body = {"model": "policy", "messages": [{"role": "user", "content": f"hi {i}"}]}
            request = urllib.request.Request(
                f"{base}/r/ep/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as resp:
                assert resp.headers["X-Capture-Status"] == "staged"
    finally:
        assert proxy.terminate() == 0, proxy.output()
    wal = Path(f"{db}-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    copy = tmp_path / "copy" / "capture.db"
    copy.parent.mkdir()
    shutil.copy(db, copy)  # the file alone, as a user would copy it
    with open_store(f"sqlite:///{copy}") as store:
        assert [r.seq for r in store.calls("ep", include_open=True)] == [0, 1, 2]
        store.verify()


# An outside reader: another process with a read transaction open on the store (a trainer
# reading it, the sqlite3 shell), held until its stdin closes.
_READER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN")
print(db.execute("SELECT count(*) FROM calls").fetchone()[0], flush=True)
sys.stdin.read()
db.execute("COMMIT")
"""


def _call(base: str, i: int) -> None:
    body = {"model": "policy", "messages": [{"role": "user", "content": f"hi {i}"}]}
    request = urllib.request.Request(
        f"{base}/r/ep/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.headers["X-Capture-Status"] == "staged"


def _copied_alone(db: Path, tmp_path: Path) -> list[int]:
    copy = tmp_path / "copy" / "capture.db"
    copy.parent.mkdir()
    shutil.copy(db, copy)  # the file alone, as a user would copy it
    with open_store(f"sqlite:///{copy}") as store:
        return [r.seq for r in store.calls("ep", include_open=True)]


def _reader(db: Path) -> subprocess.Popen[str]:
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None
    reader.stdout.readline()  # its read transaction is open
    return reader


def test_a_clean_stop_with_an_outside_reader_still_leaves_every_record_in_the_db_file(
    tmp_path: Path,
) -> None:
    """The reader's snapshot holds every commit: the writer folds every frame of the WAL into
    the file (it cannot truncate a WAL in use: the `-wal` stays, its frames already copied)."""
    db = tmp_path / "capture.db"
    proxy = start_proxy("fake", f"sqlite:///{db}")
    reader = None
    try:
        base = proxy.wait_ready()
        for i in range(3):
            _call(base, i)
        reader = _reader(db)
    finally:
        assert proxy.terminate() == 0, proxy.output()
        if reader is not None:
            reader.communicate("")
    assert _copied_alone(db, tmp_path) == [0, 1, 2]


def test_a_clean_stop_with_an_outside_reader_on_an_old_snapshot_says_why_the_file_is_not_whole(
    tmp_path: Path,
) -> None:
    """The reader's snapshot is older than the last commits: SQLite cannot copy those frames
    into the file while it reads. The proxy says so (an error naming the `-wal` to keep) and
    exits 1; nothing is lost (the frames are in `-wal`, read back at the next open)."""
    db = tmp_path / "capture.db"
    proxy = start_proxy("fake", f"sqlite:///{db}")
    reader = None
    try:
        base = proxy.wait_ready()
        _call(base, 0)
        reader = _reader(db)
        for i in range(1, 3):
            _call(base, i)
    finally:
        status = proxy.terminate()
        if reader is not None:
            reader.communicate("")
    assert status == 1, proxy.output()
    assert "capture.db-wal" in proxy.output()
    assert "outside reader" in proxy.output()
    with open_store(f"sqlite:///{db}") as store:  # with its -wal: every record
        assert [r.seq for r in store.calls("ep", include_open=True)] == [0, 1, 2]
