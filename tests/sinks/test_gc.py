"""Retention: `capture-proxy gc` removes whole sealed rollouts and nothing anything else uses."""

from __future__ import annotations

import base64
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from capture_proxy.cli import main
from capture_proxy.read.reader import open_store
from tests.support.proxy_harness import chat_body, user

ADMIN = {"Authorization": "Bearer t"}
SYSTEM = {"role": "system", "content": "You are a shell agent. " * 20}


def _image(tag: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + tag * 50).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}


async def _store_with_three_rollouts(make_proxy: Any) -> Any:
    p = await make_proxy(admin_token="t")
    shared = _image(b"shared")
    for rollout, own in (("old", _image(b"old-only")), ("recent", None), ("open", None)):
        msgs = [SYSTEM, shared] + ([own] if own else []) + [user(f"task {rollout}")]
        assert (await p.chat(chat_body(*msgs), rollout=rollout)).status == 200
    for rollout in ("old", "recent"):
        assert (await p.client.post(f"/admin/rollouts/{rollout}/seal", headers=ADMIN)).status == 200
    db = p.store_url.removeprefix("sqlite:///")
    week_ago = int(time.time() * 1000) - 7 * 86400 * 1000
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE rollouts SET sealed_at_ms = ? WHERE id = 'old'", (week_ago,))
    return p


async def test_gc_removes_old_sealed_rollouts_only(make_proxy: Any, capsys: Any) -> None:
    p = await _store_with_three_rollouts(make_proxy)
    url = p.store_url
    assert main(["gc", url, "--older-than", "1d", "--dry-run"]) == 0
    assert "would remove 1 sealed rollout(s), 1 call(s)" in capsys.readouterr().out
    with open_store(url) as store:
        assert sorted(store.rollouts()) == ["old", "open", "recent"]

    assert main(["gc", url, "--older-than", "1d"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 sealed rollout(s), 1 call(s)" in out
    assert "  old" in out
    assert "1 attachment(s)" in out  # the old rollout's own image; the shared one stays
    with open_store(url) as store:
        assert sorted(store.rollouts()) == ["open", "recent"]
        store.verify()  # no torn record, no orphan attachment, shared blobs intact
        for rollout in ("open", "recent"):
            (record,) = store.calls(rollout, include_open=True)
            assert record.request["messages"][0] == SYSTEM
            assert len(record.attachments) == 1
    # The proxy keeps working on the same store.
    assert (await p.chat(chat_body(SYSTEM, user("more")), rollout="open")).status == 200


async def test_gc_never_removes_open_rollouts(make_proxy: Any, capsys: Any) -> None:
    p = await _store_with_three_rollouts(make_proxy)
    assert main(["gc", p.store_url, "--older-than", "0s"]) == 0
    with open_store(p.store_url) as store:
        assert store.rollouts() == ["open"]
        store.verify()


def test_gc_usage_errors(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "capture_proxy", "gc", str(tmp_path / "x.db"), "--older-than", "7w"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--older-than" in run.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "capture_proxy", "gc", str(tmp_path / "x.db"), "--older-than", "7d"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1
    assert "no SQLite store" in missing.stderr
