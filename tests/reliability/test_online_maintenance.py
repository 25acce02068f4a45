"""Compaction and gc while a writer stages: on a local folder and on moto's S3 server.

A bounded load (sessions staging turns, re-sending a shared image, each sealed after a few turns
and replaced by a new one) runs on the event loop while another thread compacts and collects the
dataset over and over, deleting retired files at once (grace 0). The writer shares blobs for one
second and gc removes copies older than two (the window rule with small numbers), so blobs and
attachments are removed during the load too. Afterwards every acknowledged record of a rollout
gc did not remove reads back and verifies, every rollout gc removed is one that was sealed, and
the store verifies as a whole.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.events import EventDraft, EventKind
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.parquet import ParquetSink, compact_dataset, gc_parquet
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session, image

SHARED = image("shared")


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ds")
    else:
        moto: MotoS3 = request.getfixturevalue("moto_s3")
        yield moto.url()


@dataclass
class Maintenance:
    """What the maintenance thread did."""

    removed: set[str] = field(default_factory=set)
    blobs_removed: int = 0
    attachments_removed: int = 0
    merges: int = 0
    errors: list[BaseException] = field(default_factory=list)


def _maintain(location: str, stop: threading.Event, did: Maintenance) -> None:
    while not stop.is_set():
        try:
            stats = compact_dataset(
                location, target_bytes=1 << 30, grace_s=0, lease_ttl_s=10, shared_window_s=2.0
            )
            did.merges += stats.units_before > stats.units_after
            gone = gc_parquet(
                location,
                older_than_ms=0,
                now_ms=int(time.time() * 1000),
                lease_ttl_s=10,
                shared_window_s=2.0,
            )
            did.removed.update(gone.rollouts)
            did.blobs_removed += gone.blobs
            did.attachments_removed += gone.attachments
        except BaseException as e:  # reported by the test, not lost in the thread
            did.errors.append(e)
            return
        stop.wait(0.05)


async def test_compaction_and_gc_during_writes_lose_nothing_acknowledged(location: str) -> None:
    sink = ParquetSink(location, dedup_window_s=1.0)
    acked: dict[str, dict[str, str]] = {}  # rollout -> call id -> digest
    sealed: set[str] = set()
    did = Maintenance()
    stop = threading.Event()
    worker = threading.Thread(target=_maintain, args=(location, stop, did))
    worker.start()

    def writing(deadline: float, hard_deadline: float) -> bool:
        # At least 6 s of load, and on a slow machine (object storage on loaded cores) until gc
        # has removed blobs while the sessions write, within a bound.
        now = time.monotonic()
        return now < deadline or (did.blobs_removed == 0 and now < hard_deadline)

    async def session(n: int, deadline: float) -> None:
        generation = 0
        while writing(deadline, deadline + 20.0):
            rollout = f"s{n}-g{generation}"
            s = Session(rollout, image=SHARED if n % 2 else None)
            for turn in range(4):
                extra = image(f"{rollout}-{turn}") if turn == 1 else None
                record, attachments = s.next(new_image=extra)
                result = await sink.stage(record, attachments=attachments)
                assert result.status.value == "staged", result
                acked.setdefault(rollout, {})[record.call_id] = record.digest
            now = int(time.time() * 1000)
            await sink.put_rollout(RolloutInfo(rollout, RolloutState.SEALED, False, now, now))
            await sink.append_event(EventDraft(rollout, EventKind.SEAL, now))
            sealed.add(rollout)
            generation += 1

    try:
        deadline = time.monotonic() + 6.0
        await asyncio.gather(*(session(n, deadline) for n in range(4)))
    finally:
        stop.set()
        await asyncio.to_thread(worker.join)
        await sink.close()
    assert did.errors == []
    assert did.merges > 0
    assert did.removed
    assert did.removed <= sealed
    assert did.blobs_removed > 0
    with open_store(location) as store:
        kept = set(acked) - did.removed
        assert set(store.rollouts()) == kept
        for rollout in kept:
            records = store.calls(rollout, include_open=True)
            assert {r.call_id: r.digest for r in records} == acked[rollout]
        store.verify()  # every record's digest, every reference, every event chain
