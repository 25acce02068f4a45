"""Operator mistakes on a SQLite store: the file deleted or replaced under a running proxy, and a
second proxy started on the same file (issue 19). Real proxies, real files, real processes.

What the user must see: a deleted or replaced file stops every acknowledgement at once (the next
call is not ``staged``, ``/readyz`` is 503 naming the file, one error line in the log); a second
writer exits at start with one line naming the file and the first writer's pid, while readers
keep reading.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.support import ROOT
from tests.support.proxy_harness import ProxyFactory, chat_body, user
from tests.support.reliability_workers import Spawned, start_proxy


async def _readyz(p: Any) -> tuple[int, dict[str, Any]]:
    resp = await p.client.get("/readyz")
    body: dict[str, Any] = await resp.json()
    return resp.status, body


@pytest.mark.parametrize("how", ["unlink", "replace"])
@pytest.mark.parametrize("policy", ["poison", "error"])
async def test_a_deleted_or_replaced_store_stops_every_acknowledgement(
    how: str, policy: str, tmp_path: Path, make_proxy: ProxyFactory, caplog: Any
) -> None:
    p = await make_proxy(min_free_disk_mb=0, on_capture_failure=policy)
    db = Path(p.store_url.removeprefix("sqlite:///"))
    first = await p.chat(chat_body(user("before")))
    assert first.headers["X-Capture-Status"] == "staged"
    if how == "unlink":
        os.unlink(db)
    else:  # a restore over it: another valid store, renamed into place
        other = tmp_path / "other.db"
        await SQLiteSink(str(other)).close()
        os.replace(other, db)
    with caplog.at_level(logging.ERROR, logger="capture_proxy.sinks.sqlite._file"):
        # At once, before the guard has looked: the writer checks before acknowledging a batch.
        after = await p.chat(chat_body(user("after")))
        assert after.headers["X-Capture-Status"] == "capture_failed"
        assert after.status == (200 if policy == "poison" else 503)
        for _ in range(30):  # and the guard, once a second, whether or not calls come
            status, ready = await _readyz(p)
            if status == 503:
                break
            await asyncio.sleep(0.1)
    assert status == 503, ready
    what = "was deleted or moved away" if how == "unlink" else "was replaced by another file"
    assert any(f"{db} {what}" in problem for problem in ready["problems"]), ready
    lost = [r for r in caplog.records if r.name == "capture_proxy.sinks.sqlite._file"]
    assert len(lost) == 1, [r.getMessage() for r in lost]  # one error line, not one per call
    # It stays failed: a later call is not acknowledged either, and the rollout is poisoned.
    again = await p.chat(chat_body(user("again")))
    assert again.headers["X-Capture-Status"] == "capture_failed"
    assert p.state.capture.rollouts["r1"].poisoned


async def test_a_sink_whose_file_moved_away_refuses_every_write(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    sink = SQLiteSink(str(db))
    assert sink.problem() is None
    shutil.move(db, tmp_path / "moved.db")
    # A write to the lost file raises, naming the file, and keeps raising.
    for _ in range(2):
        with pytest.raises(StoreError, match=f"{db} was deleted or moved away"):
            await sink.mark_orphaned("c1", "probe")
    assert f"{db} was deleted or moved away" in (sink.problem() or "")
    await sink.close()


# -- two writers ------------------------------------------------------------------------------


def _wait_exit(proc: Spawned, timeout: float = 30.0) -> int:
    rc = proc.proc.wait(timeout=timeout)
    proc._reader.join(timeout=10)
    return rc


def test_a_second_proxy_on_the_same_file_is_refused_and_readers_still_read(
    tmp_path: Path,
) -> None:
    db = tmp_path / "store.db"
    url = f"sqlite:///{db}"
    first = start_proxy("fake", url, "--min-free-disk-mb", "0", cwd=ROOT)
    try:
        first.wait_ready()
        started = time.monotonic()
        second = start_proxy("fake", url, "--min-free-disk-mb", "0", cwd=ROOT)
        rc = _wait_exit(second)
        assert rc != 0, second.output()
        assert time.monotonic() - started < 30
        errors = [line for line in second.lines if str(db) in line and "writer" in line]
        assert len(errors) == 1, second.output()
        assert f"pid {first.pid}" in errors[0], errors
        assert not any("listening on" in line for line in second.lines), second.output()
        # A reader works while the writer runs.
        with open_store(url) as store:
            assert store.rollouts() == []
    finally:
        assert first.terminate() == 0, first.output()
    # Once the writer is gone, the next one starts (and a killed one leaves no stale lock).
    third = start_proxy("fake", url, "--min-free-disk-mb", "0", cwd=ROOT)
    third.wait_ready()
    third.kill()
    fourth = start_proxy("fake", url, "--min-free-disk-mb", "0", cwd=ROOT)
    fourth.wait_ready()
    assert fourth.terminate() == 0, fourth.output()


async def test_two_sinks_in_one_process_are_refused_too(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    sink = SQLiteSink(str(db))
    with pytest.raises(StoreError, match=rf"pid {os.getpid()}\).*{db}"):
        SQLiteSink(str(db))
    await sink.close()
    again = SQLiteSink(str(db))  # released by close
    await again.close()
