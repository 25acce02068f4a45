"""Ledger entries the store would not take survive the proxy's exit (issue 19).

A proxy stopped while its store fails still holds, in memory, the ledger entries of the calls it
could not stage. It must not exit 0 and drop them (the store would then show the rollout not
poisoned): it spills them to ``<store>.ledger-journal.jsonl`` (or stderr), exits 1 saying so,
and the next proxy on the store replays the journal before serving.

Real proxy processes, real files. The store fails for real: ``chattr +i`` (immutable, refused
even to root; skipped where chattr is refused), or the file deleted under the proxy (always runs).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from capture_proxy.cli import main
from capture_proxy.core.journal import STDERR_PREFIX, read_journal, spill_journal
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus, LedgerEntry
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.support import ROOT
from tests.support.disk import fill, tmpfs
from tests.support.proxy_harness import chat_body, user
from tests.support.reliability_workers import Spawned, start_proxy


async def _call(base: str, text: str) -> tuple[str, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{base}/r/r1/v1/chat/completions", json=chat_body(user(text))) as resp,
    ):
        await resp.read()
        return resp.headers["X-Capture-Status"], resp.headers["X-Capture-Call-Id"]


async def _readyz(base: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(f"{base}/readyz") as resp:
        body: dict[str, Any] = await resp.json()
        return {"status": resp.status, **body}


def _proxy(url: str) -> Spawned:
    p = start_proxy("fake", url, "--min-free-disk-mb", "0", cwd=ROOT)
    p.wait_ready()
    return p


def _chattr(flag: str, paths: list[Path]) -> None:
    done = subprocess.run(
        ["chattr", flag, *map(str, paths)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"chattr {flag} is refused here ({done.stderr.strip()})")


@pytest.mark.parametrize("fault", ["read_only", "deleted"])
async def test_held_ledger_entries_are_journaled_at_exit_and_replayed_at_start(
    fault: str, tmp_path: Path
) -> None:
    db = tmp_path / "store.db"
    url = f"sqlite:///{db}"
    journal = Path(f"{db}.ledger-journal.jsonl")
    first = _proxy(url)
    frozen: list[Path] = []
    try:
        assert (await _call(first.url, "before"))[0] == "staged"
        if fault == "read_only":
            targets = [db, Path(f"{db}-wal")]  # never -shm: a refused write there is a SIGBUS
            _chattr("+i", targets)
            frozen.extend(targets)
        else:
            os.unlink(db)
        status, failed = await _call(first.url, "during the fault " + "words " * 700)
        assert status == "capture_failed"
        ready = await _readyz(first.url)
        assert ready["status"] == 503
        assert any("ledger entries held" in problem for problem in ready["problems"]), ready
        rc = await asyncio.to_thread(first.terminate)
    finally:
        if frozen:
            _chattr("-i", frozen)
        first.kill()
    # What the operator sees: a non-zero exit, the journal, and a last line saying both.
    assert rc == 1, first.output()
    spilled = read_journal(str(journal))
    assert [(e.call_id, e.status) for e in spilled] == [(failed, CallStatus.CAPTURE_FAILED)]
    said = [line for line in first.lines if "ledger entries never reached the store" in line]
    assert len(said) == 1, first.output()
    assert str(journal) in said[0], said
    assert "exit status 1" in said[0], said

    second = _proxy(url)  # replays the journal before it serves
    try:
        assert any("replayed the ledger journal" in line for line in second.lines), second.output()
        assert not await asyncio.to_thread(journal.exists)
        with open_store(url) as store:
            ledger = store.failures("r1")
            assert [(f.call_id, f.status) for f in ledger] == [(failed, CallStatus.CAPTURE_FAILED)]
            assert store.rollout_info("r1").poisoned
        assert (await _readyz(second.url))["status"] == 200
    finally:
        assert await asyncio.to_thread(second.terminate) == 0, second.output()


async def test_a_journal_spilled_on_a_full_disk_is_applied_before_the_next_call(
    tmp_path: Path,
) -> None:
    # Issue 27: with the disk full at SIGTERM the journal could not be written, its entries went
    # to stderr, and the automatic restart handed their sequence numbers out again (two
    # answered-but-unstaged calls gone). The journal's space is now taken at start.
    with tmpfs(tmp_path / "mnt", "48m") as mnt:
        db = mnt / "store.db"
        url = f"sqlite:///{db}"
        first = _proxy(url)
        try:
            reserve = Path(f"{db}.ledger-journal.reserve")
            assert (await asyncio.to_thread(reserve.stat)).st_blocks > 0  # real blocks
            assert (await _call(first.url, "before"))[0] == "staged"
            filler = fill(mnt)
            failed = []
            for i in range(2):
                status, call_id = await _call(first.url, f"disk full {i} " + "words " * 700)
                assert status == "capture_failed"
                failed.append(call_id)
            rc = await asyncio.to_thread(first.terminate)  # SIGTERM, the disk still full
        finally:
            first.kill()
        assert rc == 1, first.output()
        journal = Path(f"{db}.ledger-journal.jsonl")
        assert [e.call_id for e in read_journal(str(journal))] == failed
        assert not [line for line in first.lines if line.startswith(STDERR_PREFIX)]
        filler.unlink()  # the operator frees the disk; systemd restarts the proxy

        second = _proxy(url)
        try:
            assert not await asyncio.to_thread(journal.exists)  # applied before it served
            assert (await _call(second.url, "after the restart"))[0] == "staged"
            with open_store(url) as store:
                ledger = store.failures("r1")
                assert [(f.call_id, f.seq) for f in ledger] == [(failed[0], 1), (failed[1], 2)]
                assert store.rollout_info("r1").poisoned
                calls = store.calls("r1", include_open=True, include_poisoned=True)
                assert [c.seq for c in calls] == [0, 3]  # no sequence number handed out twice
        finally:
            assert await asyncio.to_thread(second.terminate) == 0, second.output()
        assert not await asyncio.to_thread(reserve.exists)  # a clean stop gives it back


def _entry(call_id: str, seq: int) -> LedgerEntry:
    return LedgerEntry("r1", call_id, seq, CallStatus.CAPTURE_FAILED, "sink_error", "disk gone")


async def test_without_a_writable_journal_the_entries_go_to_stderr_and_replay_from_there(
    tmp_path: Path, capfd: Any
) -> None:
    # The journal's folder is gone too: stderr lines are the fallback.
    where = spill_journal([_entry("c1", 0), _entry("c2", 1)], str(tmp_path / "gone" / "j.jsonl"))
    assert where.startswith("stderr")
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(STDERR_PREFIX)]
    assert len(lines) == 2
    saved = tmp_path / "saved.log"
    saved.write_text("some other log line\n" + err)  # the operator saves stderr as it is
    url = f"sqlite:///{tmp_path / 's.db'}"
    await SQLiteSink(str(tmp_path / "s.db")).close()
    assert await asyncio.to_thread(main, ["replay-ledger", url, str(saved)]) == 0
    assert "2 entries written" in capfd.readouterr().out
    # Idempotent: the same entries again are skipped, not written twice.
    saved.write_text("\n".join(lines) + "\n")
    assert await asyncio.to_thread(main, ["replay-ledger", url, str(saved)]) == 0
    assert "0 entries written, 2 already" in capfd.readouterr().out
    assert not saved.exists()
    with open_store(url) as store:
        assert [f.call_id for f in store.failures("r1")] == ["c1", "c2"]
        assert store.rollout_info("r1").poisoned


def test_a_journal_line_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    entry = LedgerEntry("r1", "c1", 3, CallStatus.ABORTED, "client_gone", "é ✓", 499, 17)
    assert spill_journal([entry], str(path)) == str(path)
    assert read_journal(str(path)) == [entry]
    assert orjson.loads(path.read_bytes())["status"] == "aborted"
    path.write_text('{"rollout_id": "r1"}\n')
    with pytest.raises(StoreError, match=r"j.jsonl:1: not a ledger journal line"):
        read_journal(str(path))
