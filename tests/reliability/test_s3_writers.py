"""Three real proxy processes staging into one ``s3://`` dataset on moto's S3 server, under load
from bounded agent-like drivers: one proxy is SIGKILLed mid-load and its sandboxes move to
another proxy (a handoff of their rollouts), then it is restarted and they move back to it.
Afterwards every acknowledged call reads back and verifies, no ``(rollout, seq)`` is held twice,
and the moved rollouts record their handoffs in their event logs."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path

import pytest

from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import EventKind, check_chain
from capture_proxy.sinks.registry import open_source
from tests.support import ROOT
from tests.support.reliability_workers import Loader, Spawned, start_fake, start_proxy
from tests.support.s3 import MotoS3

#: Calls each phase waits for the moved sandboxes to have staged (load keeps running meanwhile).
PHASE_CALLS = 4


async def _until_staged(loader: Loader, n: int) -> None:
    deadline = time.monotonic() + 60.0
    want = loader.outcomes["staged"] + n
    while loader.outcomes["staged"] < want:
        assert time.monotonic() < deadline, (loader.name, dict(loader.outcomes))
        await asyncio.sleep(0.05)


def _proxy(upstream: str, url: str) -> Spawned:
    p = start_proxy(upstream, url, "--min-free-disk-mb", "0", cwd=ROOT)
    p.wait_ready(120)
    return p


def _check_store(url: str, loaders: list[Loader]) -> dict[str, int]:
    source = open_source(url)
    try:
        with Store(source) as store:
            staged = set(source.all_keys())
            acked = {call: rollout for loader in loaders for call, rollout in loader.acked.items()}
            missing = sorted(set(acked) - staged)
            assert not missing, f"{len(missing)} acknowledged calls are not in the store"
            store.verify()  # every record's digest, lineage and chain
            handoffs = 0
            for rollout in source.rollouts():
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
            return {"acked": len(acked), "staged": len(staged), "handoffs": handoffs}
    finally:
        source.close_reader()


@pytest.mark.slow
async def test_three_proxies_on_one_store_a_sigkill_a_handoff_and_a_restart(
    moto_s3: MotoS3, tmp_path: Path
) -> None:
    url = moto_s3.url()
    fake = start_fake(latency=0.1)
    proxies: list[Spawned] = []
    # Proxy 0's sandboxes are the ones handed on; the others keep proxies 1 and 2 writing.
    loaders = [Loader(f"p{i}", concurrency=2 if i == 0 else 1, seed=i, turns=6) for i in range(3)]
    try:
        proxies = [_proxy(fake.url, url) for _ in range(3)]
        for loader, proxy in zip(loaders, proxies, strict=True):
            loader.start(proxy.url)
        await _until_staged(loaders[0], PHASE_CALLS)
        # Proxy 0 dies mid-load; its sandboxes are sent to proxy 1: their rollouts are handed on.
        proxies[0].kill()
        await loaders[0].stop()
        loaders[0].start(proxies[1].url)
        await _until_staged(loaders[0], PHASE_CALLS)
        # Proxy 0 comes back; the sandboxes go back to it: their rollouts are handed on again.
        proxies[0] = _proxy(fake.url, url)
        await loaders[0].stop(finish_within=10)
        loaders[0].start(proxies[0].url)
        await _until_staged(loaders[0], PHASE_CALLS)
        for loader in loaders:
            await loader.stop(finish_within=10)
    finally:
        for p in proxies:
            p.terminate()
        fake.terminate()
    for loader in loaders:
        assert loader.outcomes["staged"] > 0, (loader.name, loader.outcomes)
    seen = await asyncio.to_thread(_check_store, url, loaders)
    assert seen["handoffs"] >= 1, seen
