"""The store fails under a running proxy, then recovers: a full filesystem, a read-only store, a
locked SQLite file, a sink that takes seconds, and the free-disk floor (docs/contract.md).

For each fault, while it lasts: every call is answered per ``--on-capture-failure`` (``poison``:
the model's answer with ``capture_failed``; ``error``: 503, or an SSE error event on a stream), the
rollout is poisoned, ``capture_proxy_calls_total{outcome="capture_failed",reason=...}`` counts the
calls, ``/readyz`` is 503 while ``/healthz`` and pass-through routes keep answering. Once the fault
clears, the next call stages, ``/readyz`` is 200 again, the store verifies, the failed calls are
not among its records and its ledger names each of them.

The faults are real where the kernel allows it here (we run as root, so permission bits do not
stop a write): a small tmpfs filled to the brim, and ``chattr +i`` (immutable: refused even to
root) for a read-only store. Both are skipped, saying why, where mounting or chattr is refused,
and a simulated full disk always runs: SQLite's own ``max_page_count`` limit (SQLITE_FULL, exactly
what SQLite reports on a full disk), and for Parquet a pyarrow filesystem whose writes fail with
ENOSPC.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow.fs as pafs
import pytest
from fsspec.implementations.local import LocalFileSystem as FsspecLocal

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.base import StagingSink
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.support.disk import fill, tmpfs
from tests.support.proxy_harness import Proxy, chat_body, sse_lines, start_proxy, stop_proxy, user

# -- what a client sees ---------------------------------------------------------------------


async def send(p: Proxy, text: str, *, stream: bool = False) -> dict[str, Any]:
    """One call; what came back: http status, capture status, call id, [DONE] seen, body."""
    resp = await p.chat(chat_body(user(text), stream=stream, max_tokens=24))
    out: dict[str, Any] = {
        "http": resp.status,
        "status": resp.headers.get("X-Capture-Status"),
        "call_id": resp.headers.get("X-Capture-Call-Id"),
        "done": False,
        "error_code": None,
    }
    if not stream or resp.status != 200:
        body = await resp.json()
        out["error_code"] = body.get("error", {}).get("code")
        out["answered"] = bool(body.get("choices"))
        return out
    async for line in sse_lines(resp):
        m = re.match(rb": capture-status (\w+) call_id=(\S+)", line)
        if m:
            out["status"] = m.group(1).decode()
            assert m.group(2).decode() == out["call_id"]
        elif line == b"data: [DONE]":
            out["done"] = True
        elif line.startswith(b"data: ") and b'"error"' in line:
            out["error_code"] = orjson.loads(line[6:])["error"]["code"]
    return out


def check_capture_failed(got: dict[str, Any], policy: str, stream: bool) -> None:
    """What docs/contract.md promises a client whose call could not be staged."""
    if policy == "poison":
        assert got["http"] == 200, got
        assert got["status"] == "capture_failed", got
        assert got["done"] if stream else got["answered"], got
    elif stream:  # error policy, headers already sent: an error event and no [DONE]
        assert got["http"] == 200, got
        assert got["error_code"] == "capture_failed", got
        assert not got["done"], got
    else:
        assert got["http"] == 503, got
        assert got["status"] == "capture_failed", got
        assert got["error_code"] == "capture_failed", got


async def metric(p: Proxy, outcome: str, reason: str) -> float:
    text = await (await p.client.get("/metrics")).text()
    m = re.search(
        rf'^capture_proxy_calls_total\{{outcome="{outcome}",reason="{reason}"\}} (\S+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


async def ready_within(p: Proxy, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        resp = await p.client.get("/readyz")
        body: dict[str, Any] = await resp.json()
        if resp.status == 200 or time.monotonic() > deadline:
            return {"status": resp.status, **body}
        await asyncio.sleep(0.1)


# -- the scenario every fault goes through ----------------------------------------------------


@dataclass
class Fault:
    reason: str  # the `reason` label of capture_failed while the fault lasts
    start: Callable[[], Awaitable[None]]
    clear: Callable[[], Awaitable[None]]
    lands_late: bool = False  # a timed-out write may still land later (then: orphaned)


async def fault_then_recovery(p: Proxy, fault: Fault, policy: str) -> None:
    before = await send(p, "before the fault")
    assert before["status"] == "staged", before
    await fault.start()
    failed = []
    for i, stream in enumerate((False, True)):
        # Long enough to need new pages / files: a short one might fit in free space.
        got = await send(p, f"during the fault {i} " + "words " * 700, stream=stream)
        check_capture_failed(got, policy, stream)
        failed.append(got["call_id"])
    assert p.state.capture.rollouts["r1"].poisoned
    assert await metric(p, "capture_failed", fault.reason) == 2
    ready = await p.client.get("/readyz")
    assert ready.status == 503, await ready.text()
    # The proxy keeps serving what does not need the store.
    assert (await p.client.get("/healthz")).status == 200
    assert (await p.client.get("/r/r1/v1/models")).status == 200

    await fault.clear()
    after = await send(p, "after the fault")
    assert after["status"] == "staged", after
    ready_again = await ready_within(p, 5.0)
    assert ready_again["status"] == 200, ready_again
    if fault.lands_late:
        await p.state.capture.drain(5.0)  # late writes land, and get marked orphaned

    with open_store(p.store_url) as store:
        store.verify()
        staged = [r.call_id for r in store.calls("r1", include_open=True, include_poisoned=True)]
        assert staged == [before["call_id"], after["call_id"]]
        ledger = [f for f in store.failures("r1") if f.status is CallStatus.CAPTURE_FAILED]
        assert {f.call_id for f in ledger} == set(failed)
        assert {f.reason for f in ledger} == {fault.reason}
        assert store.rollout_info("r1").poisoned
        landed = set(store.source.all_keys()) & set(failed)
        if fault.lands_late:
            assert landed <= store.source.orphaned()
        else:
            assert landed == set()


@pytest.fixture
async def proxies() -> AsyncIterator[Callable[..., Awaitable[Proxy]]]:
    started: list[Proxy] = []

    async def make(folder: Path, sink: StagingSink, **settings: Any) -> Proxy:
        settings.setdefault("min_free_disk_mb", 0)
        p = await start_proxy(folder, sink=sink, store=sink.url, **settings)
        p.store_url = sink.url
        started.append(p)
        return p

    yield make
    for p in started:
        await stop_proxy(p)


def sqlite_sink(folder: Path, **kw: Any) -> SQLiteSink:
    folder.mkdir(parents=True, exist_ok=True)
    return SQLiteSink(str(folder / "store.db"), **kw)


def parquet_sink(folder: Path, **kw: Any) -> ParquetSink:
    folder.mkdir(parents=True, exist_ok=True)
    return ParquetSink(str(folder / "ds"), url=f"parquet:///{folder / 'ds'}", **kw)


SINKS = {"sqlite": sqlite_sink, "parquet": parquet_sink}


# -- a full filesystem: a real tmpfs ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_full_filesystem(kind: str, tmp_path: Path, proxies: Any) -> None:
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        p = await proxies(mnt, SINKS[kind](mnt))
        filler: list[Path] = []

        async def start() -> None:
            filler.append(fill(mnt))

        async def clear() -> None:
            filler[0].unlink()

        await fault_then_recovery(p, Fault("sink_error", start, clear), "poison")
        await stop_proxy(p)  # before the unmount


async def test_free_disk_floor_refuses_calls_then_recovers(tmp_path: Path, proxies: Any) -> None:
    with tmpfs(tmp_path / "mnt", "12m") as mnt:
        p = await proxies(mnt, sqlite_sink(mnt), min_free_disk_mb=6)
        assert (await send(p, "plenty of room"))["status"] == "staged"
        filler = fill(mnt, leave=3 * 2**20)
        forwarded = len(p.fake.requests)
        for _ in range(100):  # the guard looks once a second
            if p.state.capture.unavailable_reason:
                break
            await asyncio.sleep(0.05)
        resp = await p.chat(chat_body(user("no room")))
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "5"
        err = (await resp.json())["error"]
        assert err["code"] == "capture_unavailable"
        assert "below the floor (6 MiB)" in err["message"]
        assert len(p.fake.requests) == forwarded  # refused before forwarding: nothing half-done
        assert (await p.client.get("/readyz")).status == 503
        filler.unlink()
        ready = await ready_within(p, 5.0)
        assert ready["status"] == 200, ready
        assert (await send(p, "room again"))["status"] == "staged"
        assert [f.reason for f in p.failures()] == ["capture_unavailable"]
        await stop_proxy(p)


# -- a full disk, simulated (always runs) -----------------------------------------------------


class PageLimitedSQLiteSink(SQLiteSink):
    """A SQLite sink whose file may not grow while `limit` is on: SQLite then fails writes with
    SQLITE_FULL ("database or disk is full"), what it reports when the disk is full."""

    async def limit(self, on: bool) -> None:
        def work(conn: sqlite3.Connection, batch: Any) -> None:
            pages = conn.execute("PRAGMA page_count").fetchone()[0] if on else 4294967294
            conn.execute(f"PRAGMA max_page_count = {pages}")

        await self._writer.submit(work)


class FillingDisk(FsspecLocal):
    """A local filesystem (fsspec's) whose new files fail with ENOSPC while `full` is set."""

    cachable = False  # fsspec would otherwise share one instance, and `full`, between tests

    def __init__(self) -> None:
        super().__init__()
        self.full = False

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if self.full and mode[0] in "wax":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super()._open(path, mode, **kwargs)


@pytest.mark.parametrize("policy", ["poison", "error"])
async def test_simulated_full_disk_sqlite(policy: str, tmp_path: Path, proxies: Any) -> None:
    sink = PageLimitedSQLiteSink(str(tmp_path / "store.db"))
    p = await proxies(tmp_path, sink, on_capture_failure=policy)

    async def start() -> None:
        await sink.limit(True)

    async def clear() -> None:
        await sink.limit(False)

    await fault_then_recovery(p, Fault("sink_error", start, clear), policy)


@pytest.mark.parametrize("policy", ["poison", "error"])
async def test_simulated_full_disk_parquet(policy: str, tmp_path: Path, proxies: Any) -> None:
    disk = FillingDisk()
    ds = tmp_path / "ds"
    sink = ParquetSink(
        str(ds), url=f"parquet:///{ds}", filesystem=pafs.PyFileSystem(pafs.FSSpecHandler(disk))
    )
    p = await proxies(tmp_path, sink, on_capture_failure=policy)

    async def start() -> None:
        disk.full = True

    async def clear() -> None:
        disk.full = False

    await fault_then_recovery(p, Fault("sink_error", start, clear), policy)


# -- a read-only store: chattr +i ---------------------------------------------------------------


def chattr(flag: str, paths: list[Path]) -> None:
    done = subprocess.run(
        ["chattr", flag, *map(str, paths)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"chattr {flag} is refused here ({done.stderr.strip()})")


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_read_only_store(kind: str, tmp_path: Path, proxies: Any) -> None:
    # As root, permission bits do not stop a write; the immutable flag does. SQLite: the file and
    # its WAL (never the -shm index, which SQLite maps into memory: a refused write there is a
    # SIGBUS). Parquet: its folders, so no new file can be created in them.
    p = await proxies(tmp_path, SINKS[kind](tmp_path))
    if kind == "sqlite":
        targets = [tmp_path / "store.db", tmp_path / "store.db-wal"]
    else:
        targets = [d for d in (tmp_path / "ds").iterdir() if d.is_dir()]
    frozen: list[Path] = []

    async def start() -> None:
        chattr("+i", targets)
        frozen.extend(targets)

    async def clear() -> None:
        chattr("-i", frozen)
        frozen.clear()

    try:
        await fault_then_recovery(p, Fault("sink_error", start, clear), "poison")
    finally:
        if frozen:
            chattr("-i", frozen)


# -- a locked SQLite file, a slow sink --------------------------------------------------------


@contextmanager
def exclusive_lock(db: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(db, isolation_level=None, timeout=0)
    try:
        yield conn
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()


class SlowDisk:
    """A sink fault hook that makes each record's write take `seconds` (on the writer thread,
    inside the write, as a slow disk would)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, point: str) -> None:
        if point == "after_record":
            time.sleep(self.seconds)


async def test_locked_sqlite_file(tmp_path: Path, proxies: Any) -> None:
    # The sink waits on a lock for its busy timeout (10 s), longer than the stage timeout here:
    # the calls fail with stage_timeout, and their writes land once the lock is gone (orphaned).
    p = await proxies(tmp_path, sqlite_sink(tmp_path), stage_timeout=0.4)
    with exclusive_lock(tmp_path / "store.db") as other:

        async def start() -> None:
            other.execute("BEGIN EXCLUSIVE")

        async def clear() -> None:
            other.execute("ROLLBACK")

        await fault_then_recovery(
            p, Fault("stage_timeout", start, clear, lands_late=True), "poison"
        )


async def test_slow_sink_times_out_and_orphans_late_writes(tmp_path: Path, proxies: Any) -> None:
    disk = SlowDisk(0.0)
    p = await proxies(tmp_path, sqlite_sink(tmp_path, fault=disk), stage_timeout=0.3)

    async def start() -> None:
        disk.seconds = 0.8

    async def clear() -> None:
        disk.seconds = 0.0
        await p.state.capture.drain(10.0)

    await fault_then_recovery(p, Fault("stage_timeout", start, clear, lands_late=True), "poison")


async def test_staging_backlog_refuses_new_calls_with_retry_after(
    tmp_path: Path, proxies: Any
) -> None:
    # Each call gives up after 0.1 s while its write takes 1 s on the one writer thread: late
    # writes pile up until the bound, then new calls are refused before anything is forwarded.
    disk = SlowDisk(1.0)
    p = await proxies(
        tmp_path, sqlite_sink(tmp_path, fault=disk), stage_timeout=0.1, max_pending_stages=2
    )
    got = []
    for i in range(6):
        resp = await p.chat(chat_body(user(f"call {i}")))
        got.append((resp.status, resp.headers.get("X-Capture-Status")))
        if resp.status == 503:
            assert resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "staging_backlog"
            break
    else:
        pytest.fail(f"never refused: {got}")
    assert got[:-1] == [(200, "capture_failed")] * 2
    assert p.state.capture.pending_stages == 2
    assert len(p.fake.requests) == 2  # the refused call was not forwarded
    disk.seconds = 0.0
    await p.state.capture.drain(10.0)
    assert p.state.capture.pending_stages == 0
    assert (await send(p, "the backlog has drained"))["status"] == "staged"
    with open_store(p.store_url) as store:
        store.verify()
        assert (
            len(store.calls("r1", include_open=True, include_poisoned=True)) == 1
        )  # the late writes are orphaned
        assert (
            len(store.calls("r1", include_orphaned=True, include_open=True, include_poisoned=True))
            == 3
        )
        assert len(store.source.orphaned()) == 2


async def test_a_burst_never_has_more_writes_pending_than_the_bound(
    tmp_path: Path, proxies: Any
) -> None:
    p = await proxies(
        tmp_path,
        sqlite_sink(tmp_path, fault=SlowDisk(0.2)),
        stage_timeout=0.1,
        max_pending_stages=3,
    )
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, p.state.capture.pending_stages)
            await asyncio.sleep(0.002)

    watcher = asyncio.ensure_future(watch())
    burst = await asyncio.gather(*(p.chat(chat_body(user(f"burst {i}"))) for i in range(12)))
    watcher.cancel()
    await p.state.capture.drain(10.0)
    statuses = sorted(r.status for r in burst)
    assert set(statuses) <= {200, 503}, statuses
    assert peak <= 3, f"{peak} writes pending at once, the bound is 3"


# -- known gaps (the lead owns the code; see the report) ---------------------------------------


async def test_each_failure_is_in_the_ledger_once_after_a_lock(
    tmp_path: Path, proxies: Any
) -> None:
    p = await proxies(tmp_path, sqlite_sink(tmp_path), stage_timeout=0.3)
    with exclusive_lock(tmp_path / "store.db") as other:
        other.execute("BEGIN EXCLUSIVE")
        failed = await send(p, "while locked")
        other.execute("ROLLBACK")
    assert failed["status"] == "capture_failed"
    assert (await ready_within(p, 5.0))["status"] == 200
    with open_store(p.store_url) as store:
        entries = [f.call_id for f in store.failures("r1")]
    assert entries == [failed["call_id"]]


async def test_late_writes_at_shutdown_are_still_marked_orphaned(
    tmp_path: Path, proxies: Any
) -> None:
    p = await proxies(tmp_path, sqlite_sink(tmp_path, fault=SlowDisk(0.6)), stage_timeout=0.1)
    failed = [await send(p, f"slow {i}") for i in range(2)]
    assert [f["status"] for f in failed] == ["capture_failed"] * 2
    await stop_proxy(p)  # a graceful stop while the writes are still on their way
    with open_store(p.store_url) as store:
        assert store.calls("r1", include_open=True, include_poisoned=True) == []
        assert {f["call_id"] for f in failed} <= store.source.orphaned()


async def test_client_gone_during_staging_still_gets_an_outcome(
    tmp_path: Path, proxies: Any
) -> None:
    disk = SlowDisk(0.6)
    p = await proxies(tmp_path, sqlite_sink(tmp_path, fault=disk), admin_token="t")
    call = asyncio.ensure_future(p.chat(chat_body(user("I will not wait"))))
    for _ in range(500):
        if p.state.capture.pending_stages:
            break
        await asyncio.sleep(0.01)
    call.cancel()  # the sandbox goes away while its record is being written
    await p.state.capture.drain(5.0)
    await asyncio.sleep(0.7)
    manifest = await (
        await p.client.get("/admin/rollouts/r1/manifest", headers={"Authorization": "Bearer t"})
    ).json()
    (entry,) = manifest["calls"]
    with open_store(p.store_url) as store:
        landed = [
            r.call_id
            for r in store.calls(
                "r1", include_orphaned=True, include_open=True, include_poisoned=True
            )
        ]
    assert landed == [entry["call_id"]]
    assert entry["status"] != "pending", manifest
    counted = await metric(p, "staged", "ok") + await metric(p, "aborted", "client_disconnected")
    assert counted == 1


# -- readiness comes back by itself (issue 27) --------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_readiness_recovers_once_the_store_takes_writes_again_with_no_call(
    kind: str, tmp_path: Path, proxies: Any
) -> None:
    # Behind a Kubernetes Service a pod whose readiness failed gets no calls: before, /readyz
    # stayed 503 "sink failing" until a call staged, so it never came back into rotation.
    if kind == "sqlite":
        sqlite = PageLimitedSQLiteSink(str(tmp_path / "store.db"))
        p = await proxies(tmp_path, sqlite)

        async def full(on: bool) -> None:
            await sqlite.limit(on)
    else:
        disk = FillingDisk()
        ds = tmp_path / "ds"
        handler = pafs.PyFileSystem(pafs.FSSpecHandler(disk))
        p = await proxies(
            tmp_path, ParquetSink(str(ds), url=f"parquet:///{ds}", filesystem=handler)
        )

        async def full(on: bool) -> None:
            disk.full = on

    await full(True)
    got = await send(p, "during the fault " + "words " * 700)
    assert got["status"] == "capture_failed", got
    await asyncio.sleep(2.5)  # the guard probes once a second: still failing, still said
    still = await p.client.get("/readyz")
    assert still.status == 503
    assert any("sink failing" in problem for problem in (await still.json())["problems"])
    await full(False)
    ready = await ready_within(p, 5.0)  # no call in between
    assert ready["status"] == 200, ready
    assert (await send(p, "after the fault"))["status"] == "staged"
    with open_store(p.store_url) as store:
        store.verify()
        assert [f.status for f in store.failures("r1")] == [CallStatus.CAPTURE_FAILED]
