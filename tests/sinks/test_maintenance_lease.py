"""The maintenance lease (`_leases/maintenance`): one compaction or gc at a time per Parquet
dataset, on a local folder and on moto's S3 server; a holder that died is taken over once its
lease expires, a holder that stalled past its expiry learns it lost the lease before it commits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pyarrow.fs as pafs
import pytest

from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.parquet import LeaseLost, ParquetSink, gc_parquet, maintenance_lease
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._lease import LEASE, NEXT
from tests.support.s3 import MotoS3

#: A maintenance run in another process: takes the lease, says so, then checks it once a line
#: arrives on stdin (after a stall) and prints what the check said.
_HOLDER = """
import sys
from capture_proxy.sinks.parquet import maintenance_lease
with maintenance_lease(sys.argv[1], "compact", ttl_s=float(sys.argv[2])) as lease:
    print(lease.holder, flush=True)
    sys.stdin.readline()
    try:
        lease.check()
        print("held", flush=True)
    except Exception as e:
        print(type(e).__name__, e, flush=True)
"""


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ds")
    else:
        moto: MotoS3 = request.getfixturevalue("moto_s3")
        yield moto.url()


def _resolution_s(location: str) -> float:
    """How much later than its ttl a lease may be taken over: the expiry is judged on the
    store's clock, by Last-Modified stamps in whole seconds on object storage (a second added
    to the ttl, and an age read up to a second short)."""
    return 2.0 if location.startswith("s3://") else 0.0


def _holder(location: str, ttl_s: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, location, str(ttl_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_second_run_is_refused_naming_the_holder_until_the_first_releases(
    location: str,
) -> None:
    with maintenance_lease(location, "gc") as first:
        with pytest.raises(StoreError) as refused, maintenance_lease(location, "compact"):
            pass
        message = str(refused.value)
        assert message.startswith(
            f"another maintenance run holds {location.removeprefix('s3://')}/_leases/maintenance: "
            f"gc by {first.holder}, until "
        )
        assert "run compact again once it has finished" in message
        first.check()
    with maintenance_lease(location, "compact") as second:  # released: taken at once
        second.check()


def test_a_holder_that_died_is_taken_over_once_its_lease_expires(location: str) -> None:
    proc, holder = _holder(location, 2.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with (
        pytest.raises(StoreError, match=f"compact by {holder}, until"),
        maintenance_lease(location, "gc"),
    ):
        pass
    time.sleep(2.1 + _resolution_s(location))
    with maintenance_lease(location, "gc") as lease:
        lease.check()


def test_a_holder_that_stalled_past_its_expiry_stops_before_committing(location: str) -> None:
    proc, holder = _holder(location, 1.5)
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.send_signal(signal.SIGSTOP)  # a paused VM: no renewal
    try:
        time.sleep(1.6 + _resolution_s(location))
        with maintenance_lease(location, "gc", ttl_s=30) as taker:
            proc.send_signal(signal.SIGCONT)
            proc.stdin.write("go on\n")
            proc.stdin.flush()
            said = proc.stdout.readline().strip()
            taker.check()  # the new holder keeps it: the old one's renewal is refused
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=30)
    assert said.startswith("LeaseLost compact of ")
    assert said.endswith(
        "stopped: its maintenance lease was lost (another run took it over (this run stalled "
        "past its expiry)); nothing more was committed, run it again"
    ) or said.endswith(
        "stopped: its maintenance lease was lost (it is about to expire and was not renewed in "
        "time); nothing more was committed, run it again"
    )
    assert holder not in said


def test_of_runs_taking_an_expired_lease_at_once_exactly_one_wins(location: str) -> None:
    with maintenance_lease(location, "compact"):
        pass  # released: an expired body is left, so every taker goes through its etag
    start = threading.Barrier(6)
    won: list[str] = []
    refused: list[str] = []
    release = threading.Event()

    def take() -> None:
        start.wait()
        try:
            with maintenance_lease(location, "gc") as lease:
                won.append(lease.holder)
                release.wait(30)
        except StoreError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(won) + len(refused) < 6 and time.monotonic() < deadline:
        if len(refused) == 5:
            break
        time.sleep(0.05)
    release.set()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert len(refused) == 5
    assert all(
        "another maintenance run" in r and ("took" in r or f"gc by {won[0]}" in r) for r in refused
    )


def test_a_lost_lease_raises_lease_lost_at_the_next_check(location: str) -> None:
    with maintenance_lease(location, "compact", ttl_s=0.9) as lease:
        lease._stop.set()  # renewals stop, as in a stall of this thread
        time.sleep(0.7)  # under a third of the ttl is left
        with pytest.raises(LeaseLost, match="about to expire and was not renewed in time"):
            lease.check()


async def test_object_storage_given_as_a_filesystem_object_is_refused(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await ParquetSink(url).close()
    fs = pafs.S3FileSystem(endpoint_override=moto_s3.endpoint, scheme="http")
    path = url.removeprefix("s3://")
    with pytest.raises(StoreError) as refused:
        gc_parquet(path, older_than_ms=0, now_ms=0, filesystem=fs)
    assert str(refused.value).startswith(
        f"maintenance of {path} needs conditional writes, which capture-proxy makes through "
        "obstore; obstore cannot open this URL: "
    )


def _write_lease(location: str, body: dict[str, object]) -> None:
    """A lease body as another host wrote it (its clock in `expires_at_ms`, `written_at_ms`)."""
    DatasetFS(location).put_all({LEASE: orjson.dumps(body)})


def test_expiry_is_judged_on_the_stores_clock_not_the_holders(location: str) -> None:
    now_ms = int(time.time() * 1000)
    hour_ms = 3_600_000
    common = {"purpose": "compact", "released": False, "nonce": "n"}
    if not location.startswith("s3://"):
        os.makedirs(os.path.join(location, "_leases"), exist_ok=True)
    # A holder whose clock is an hour behind: by its own expiry the lease is long over, but it
    # was written just now, and holds for its ttl.
    _write_lease(
        location,
        {"holder": "behind:1:a", "ttl_ms": 60_000, "expires_at_ms": now_ms - hour_ms} | common,
    )
    with (
        pytest.raises(StoreError, match="compact by behind:1:a"),
        maintenance_lease(location, "gc"),
    ):
        pass
    # A holder whose clock is an hour ahead, with a 1.5 s ttl: taken once 1.5 s have passed on
    # the store's clock, whatever its expiry says.
    _write_lease(
        location,
        {"holder": "ahead:1:b", "ttl_ms": 1500, "expires_at_ms": now_ms + hour_ms} | common,
    )
    with (
        pytest.raises(StoreError, match="compact by ahead:1:b"),
        maintenance_lease(location, "gc"),
    ):
        pass
    time.sleep(1.6 + _resolution_s(location))
    with maintenance_lease(location, "gc") as lease:
        lease.check()


def test_a_waiting_run_takes_the_next_turn_before_runs_that_come_meanwhile(
    location: str,
) -> None:
    got: list[str] = []
    refused: list[str] = []
    first = maintenance_lease(location, "compact")
    holder = first.__enter__()

    def wait_for_it() -> None:
        with maintenance_lease(location, "gc", wait_s=30) as lease:
            got.append(lease.holder)

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    dfs = DatasetFS(location)
    deadline = time.monotonic() + 20
    while not dfs.exists(NEXT) and time.monotonic() < deadline:
        time.sleep(0.05)  # until the waiter has reserved the next turn
    assert dfs.exists(NEXT)
    first.__exit__(None, None, None)
    # The lease is free, but the waiter holds the next turn: a run coming now is refused.
    try:
        with maintenance_lease(location, "compact"):
            pass
    except StoreError as e:
        refused.append(str(e))
    waiter.join(30)
    assert not waiter.is_alive()
    assert len(got) == 1
    assert got[0] != holder.holder
    assert len(refused) == 1
    assert "gc by " in refused[0]
    assert "run compact again once it has finished" in refused[0]
    with maintenance_lease(location, "compact") as after:  # the reservation was released
        after.check()


def test_a_run_that_waits_in_vain_is_refused_naming_the_holder(location: str) -> None:
    with maintenance_lease(location, "compact") as first:
        started = time.monotonic()
        with (
            pytest.raises(StoreError, match=f"compact by {first.holder}"),
            maintenance_lease(location, "gc", wait_s=1.5),
        ):
            pass
        assert time.monotonic() - started >= 1.5
