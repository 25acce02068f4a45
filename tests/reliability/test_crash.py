"""SIGKILL a process that is staging, at random moments, round after round on the same store:
every record it acknowledged is there and verifies, nothing is torn, and the store still opens
for writing. Both sinks, one worker (tests/support/crash_worker.py). (Power loss is argued in
docs/storage.md; a kill is what a test can do.)
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.registry import open_sink, open_source
from tests.support import ROOT
from tests.support.sink_factories import Session

WORKER = "tests.support.crash_worker"  # run by `python -m` from ROOT
ROUNDS = 5
SEED = 20261129


class Worker:
    """The worker process, with its stdout collected line by line on a thread."""

    def __init__(self, store: str, round_no: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WORKER, store, "loop", "--round", str(round_no)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.lines: list[bytes] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line == b"ready\n":
                self.ready.set()

    def kill(self) -> tuple[int, str]:
        """SIGKILL it (if still running); its return code and stderr."""
        self.proc.send_signal(signal.SIGKILL)
        rc = self.proc.wait(timeout=10)
        self._reader.join(timeout=10)
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        stderr = self.proc.stderr.read().decode(errors="replace")
        self.proc.stdout.close()
        self.proc.stderr.close()
        return rc, stderr

    def acknowledged(self) -> list[str]:
        # A line cut short by the kill has no newline: its stage() returned, but the key was
        # not fully printed, so the test does not count it (the store may still hold it).
        return [
            line[:-1].decode()
            for line in self.lines
            if line.endswith(b"\n") and line not in (b"ready\n", b"done\n")
        ]


@pytest.mark.slow  # rounds of a real worker process killed mid-write: ~10-20 s per sink
@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
def test_sigkill_loses_no_acknowledged_record(tmp_path: Path, kind: str) -> None:
    store = (
        f"sqlite:///{tmp_path / 'crash.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/crash"
    )
    rng = random.Random(SEED)
    acknowledged: list[str] = []
    killed_mid_write = 0
    for round_no in range(ROUNDS):
        worker = Worker(store, round_no)
        ready = worker.ready.wait(20)
        if ready:
            # The random moment counts from the round's first acknowledged record, so a slow
            # start (a loaded machine, a Parquet dataset being indexed) cannot eat the round.
            deadline = time.monotonic() + 20
            while not worker.acknowledged() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.1, 1.0))
        rc, stderr = worker.kill()
        assert ready, f"the worker did not start:\n{stderr}"
        assert rc in (-signal.SIGKILL, 0), f"worker failed on its own (rc {rc}):\n{stderr}"
        killed_mid_write += rc == -signal.SIGKILL
        keys = worker.acknowledged()
        acknowledged += keys

        with open_store(store) as s:
            records = s.fetch(acknowledged)  # present, and every digest verifies
            assert [r.call_id for r in records] == acknowledged
            s.verify()  # no torn record, no attachment without its record
            assert set(acknowledged) <= set(s.source.all_keys())
    assert killed_mid_write >= ROUNDS - 1, "the worker finished before it could be killed"
    assert len(acknowledged) >= ROUNDS * 10, f"too little was staged: {len(acknowledged)}"
    # Sessions continued across kills: later rounds extended what earlier rounds staged. Any
    # later round: on a loaded machine the last round may find every earlier session finished,
    # or cut after its claim (a seq that reads lost_in_crash ends its session), and start anew.
    resumed = [k for k in acknowledged if any(k.startswith(f"r{n}-r") for n in range(1, ROUNDS))]
    assert resumed, acknowledged[-20:]

    async def write_again() -> None:
        source = open_source(store)
        # A rollout whose last record holds its last claim (a seq a killed call claimed is
        # taken for good: the store refuses it to anyone else).
        last = next(
            calls[-1]
            for calls in map(source.calls, source.rollouts())
            if calls and calls[-1].seq >= max(source.claims(calls[-1].rollout_id), default=-1)
        )
        source.close_reader()
        sink = open_sink(store)
        record, _ = Session.resume(last, prefix="after").next()
        result = await sink.stage(record)
        await sink.close()
        assert result.status is CallStatus.STAGED
        assert result.coords is not None
        assert result.coords.prev_len == last.cum_len

    asyncio.run(write_again())
    with open_store(store) as s:
        s.verify()
