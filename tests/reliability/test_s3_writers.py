"""Three real proxy processes staging into one ``s3://`` dataset on moto's S3 server, under load
from bounded agent-like drivers that seal each finished session's rollout, while real
``capture-proxy compact`` and ``capture-proxy gc`` processes run one after the other in a loop
(online, each taking the maintenance lease): one proxy is SIGKILLed mid-load and its sandboxes
move to another proxy (a handoff of their rollouts), then it is restarted and they move back to
it. Afterwards every maintenance run exited 0 (or was refused because the lease was held), a
compaction merged units and gc removed sealed rollouts while the load ran, every acknowledged
call of a rollout gc kept reads back and verifies, gc removed only sealed rollouts, no
``(rollout, seq)`` is held twice, and the moved rollouts record their handoffs in their event
logs."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import EventKind, check_chain
from capture_proxy.sinks.parquet import ParquetSource
from tests.support import ROOT
from tests.support.reliability_workers import Loader, Spawned, start_fake, start_proxy
from tests.support.s3 import MotoS3

#: Calls each phase waits for the moved sandboxes to have staged (load keeps running meanwhile).
PHASE_CALLS = 4
#: How long a phase may take. The restarted proxy's first calls resume their rollouts from the
#: store, which on a busy machine took up to a minute (it indexes every unit written so far).
PHASE_WAIT_S = 120.0
#: How long the load may go on after the phases, waiting for maintenance to have done its work.
MAINTENANCE_WAIT_S = 60.0
#: How long the moved sandboxes' calls on proxy 1 may take to end before they move back.
HANDBACK_WAIT_S = 30.0
_ADMIN = "s3-writers-admin"
#: What a maintenance run refused because another run holds the lease says (docs/storage.md).
_LEASE_HELD = "another maintenance run holds"


@dataclass
class Maintenance:
    """What the maintenance loop's ``compact`` and ``gc`` processes did."""

    #: Each run's command, exit status and seconds, in order.
    log: list[tuple[str, int | None, float]] = field(default_factory=list)
    merges: int = 0
    refused: int = 0
    removed: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)


async def _run(did: Maintenance, *argv: str) -> dict[str, Any] | None:
    """One ``capture-proxy`` maintenance process; its ``--json`` summary, or None if refused."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "capture_proxy",
        *argv,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    did.log.append((argv[0], proc.returncode, round(time.monotonic() - started, 1)))
    if proc.returncode == 1 and _LEASE_HELD in err.decode():
        did.refused += 1
        return None
    if proc.returncode != 0:
        did.failures.append(f"{argv[0]} exited {proc.returncode}: {err.decode()[-2000:]}")
        return None
    summary: dict[str, Any] = json.loads(out)
    return summary


async def _maintain(
    url: str, phases_done: asyncio.Event, stop: asyncio.Event, did: Maintenance
) -> None:
    """Compact, then gc every rollout sealed more than a second ago, over and over, until `stop`
    or a run fails, or once `phases_done` is set and a compaction has merged units and gc has
    removed a rollout; a run in progress finishes."""

    def done() -> bool:
        enough = phases_done.is_set() and did.merges > 0 and bool(did.removed)
        return stop.is_set() or bool(did.failures) or enough

    while not done():
        compacted = await _run(did, "compact", "--json", url)
        if compacted is not None:
            did.merges += compacted["units_before"] > compacted["units_after"]
        if done():
            break
        collected = await _run(did, "gc", "--older-than", "1s", "--json", url)
        if collected is not None:
            did.removed.update(collected["rollouts"])


async def _until_staged(loader: Loader, n: int) -> None:
    deadline = time.monotonic() + PHASE_WAIT_S
    want = loader.outcomes["staged"] + n
    while loader.outcomes["staged"] < want:
        assert time.monotonic() < deadline, (loader.name, dict(loader.outcomes))
        await asyncio.sleep(0.05)


def _proxy(upstream: str, url: str) -> Spawned:
    """A proxy process starting; `_ready` waits for it."""
    return start_proxy(upstream, url, "--min-free-disk-mb", "0", "--admin-token", _ADMIN, cwd=ROOT)


async def _ready(*proxies: Spawned) -> None:
    """Until the proxies listen: together, and off the event loop, so the load goes on."""
    await asyncio.gather(*(asyncio.to_thread(p.wait_ready, 120) for p in proxies))


def _check_store(url: str, loaders: list[Loader], removed: set[str]) -> dict[str, int]:
    source = ParquetSource(url)
    try:
        # One listing of the units for every read below (not one LIST per read).
        with source.snapshot(), Store(source) as store:
            staged = set(source.all_keys())
            acked = {
                call: rollout
                for loader in loaders
                for call, rollout in loader.acked.items()
                if rollout not in removed
            }
            missing = sorted(set(acked) - staged)
            assert not missing, f"{len(missing)} acknowledged calls are not in the store"
            store.verify()  # every record's digest, lineage and chain
            rollouts = set(source.rollouts())
            assert not rollouts & removed, "rollouts gc removed are still listed"
            handoffs = 0
            for rollout in rollouts:
                # A call may be both staged (late, marked orphaned) and in the ledger (its stage
                # timed out): one call. Two calls at one seq would be a duplicate.
                holders: dict[int, set[str]] = defaultdict(set)
                for summary in source.summaries(rollout):
                    holders[summary.seq].add(summary.call_id)
                for failure in source.failures(rollout):
                    holders[failure.seq].add(failure.call_id)
                twice = {seq: calls for seq, calls in holders.items() if len(calls) > 1}
                assert not twice, f"rollout {rollout}: seqs held by two calls: {twice}"
                events = source.events(rollout)
                assert check_chain(events) == [], rollout
                handoffs += sum(1 for e in events if e.kind == EventKind.HANDOFF)
            return {
                "acked_kept": len(acked),
                "staged": len(staged),
                "rollouts_kept": len(rollouts),
                "handoffs": handoffs,
            }
    finally:
        source.close_reader()


@pytest.mark.slow
async def test_three_proxies_on_one_store_with_compaction_and_gc_a_sigkill_and_a_handoff(
    moto_s3: MotoS3, tmp_path: Path
) -> None:
    url = moto_s3.url()
    fake = start_fake(latency=0.1)
    proxies: list[Spawned] = []
    spawned: list[Spawned] = []  # proxies replaced during the run
    # Proxy 0's sandboxes are the ones handed on (their rollouts stay open, so gc keeps them and
    # their handoffs); the others keep proxies 1 and 2 writing and sealing rollouts for gc.
    loaders = [
        Loader("p0", concurrency=2, seed=0, turns=1000, admin_token=_ADMIN),
        *(Loader(f"p{i}", concurrency=1, seed=i, turns=3, admin_token=_ADMIN) for i in (1, 2)),
    ]
    did = Maintenance()
    phases_done, stop_maintenance = asyncio.Event(), asyncio.Event()
    maintenance: asyncio.Task[None] | None = None
    try:
        proxies = [_proxy(fake.url, url) for _ in range(3)]
        await _ready(*proxies)
        for loader, proxy in zip(loaders, proxies, strict=True):
            loader.start(proxy.url)
        maintenance = asyncio.ensure_future(_maintain(url, phases_done, stop_maintenance, did))
        started = time.monotonic()
        await _until_staged(loaders[0], PHASE_CALLS)
        # Proxy 0 dies mid-load; its sandboxes are sent to proxy 1: their rollouts are handed on.
        proxies[0].kill()
        spawned.append(proxies[0])
        await loaders[0].stop()
        loaders[0].start(proxies[1].url)
        await _until_staged(loaders[0], PHASE_CALLS)
        # Proxy 0 comes back; the sandboxes go back to it: their rollouts are handed on again,
        # once their calls on proxy 1 have ended (a call still running there would append to
        # the rollout's event chain beside proxy 0: two writers at once, which forks it).
        proxies[0] = _proxy(fake.url, url)
        await _ready(proxies[0])
        cut = await loaders[0].stop(finish_within=HANDBACK_WAIT_S)
        assert cut == 0, f"{cut} calls on proxy 1 still running after {HANDBACK_WAIT_S} s"
        loaders[0].start(proxies[0].url)
        await _until_staged(loaders[0], PHASE_CALLS)
        phases_s = time.monotonic() - started
        # The load goes on until the maintenance loop has done its work (bounded): every
        # maintenance run happens while the proxies take load.
        phases_done.set()
        await asyncio.wait({maintenance}, timeout=MAINTENANCE_WAIT_S)
        assert maintenance.done(), did
        load_s = time.monotonic() - started
        for loader in loaders:
            await loader.stop(finish_within=10)
    finally:
        for loader in loaders:  # the load stops first when a step above failed
            await loader.stop()
        stop_maintenance.set()
        if maintenance is not None:
            await maintenance
        await asyncio.gather(*(asyncio.to_thread(p.terminate) for p in proxies))
        fake.terminate()
        # Each proxy's whole output, for a failure's diagnosis (the SIGKILLed one first).
        for i, p in enumerate([*spawned, *proxies]):
            (tmp_path / f"proxy-{i}.log").write_text("\n".join(p.lines) + "\n")
    assert did.failures == [], did.failures
    assert did.merges > 0, did
    assert did.removed, did
    sealed = {rollout for loader in loaders for rollout in loader.sealed}
    assert did.removed <= sealed, did.removed - sealed
    for loader in loaders:
        assert loader.outcomes["staged"] > 0, (loader.name, loader.outcomes)
    seen = await asyncio.to_thread(_check_store, url, loaders, did.removed)
    assert seen["handoffs"] >= 1, seen
    acked = sum(len(loader.acked) for loader in loaders)
    outcomes = {loader.name: dict(loader.outcomes) for loader in loaders}
    print(
        f"\n{acked} calls acknowledged; {seen}; outcomes: {outcomes}; "
        f"maintenance: {len(did.log)} runs "
        f"({did.refused} refused), {did.merges} compactions merged units, "
        f"{len(did.removed)} rollouts removed; load {load_s:.0f} s "
        f"(phases {phases_s:.0f} s); runs: {did.log}; proxies' output in {tmp_path}"
    )
