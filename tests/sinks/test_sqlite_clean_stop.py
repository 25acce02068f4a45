"""A clean stop leaves one self-contained SQLite file: a user who copies only `capture.db` after
stopping the proxy copies every record (nothing left behind in `-wal`)."""

from __future__ import annotations

import json
import shutil
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
