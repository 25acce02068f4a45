"""SIGKILL a real proxy while a call is in flight (the fake vLLM holds that call's answer until the
proxy goes): the call's seq was claimed at admission, so after a restart the store accounts for it
as ``lost_in_crash``, its rollout reads poisoned, and the next call takes the seq after it. Both
sinks. On Parquet the claim file is then the only trace of the call, and the store head the proxy
published covers it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from capture_proxy.read.reader import StoreCorrupted, open_store
from capture_proxy.schemas.store_head import StoreHead
from capture_proxy.sinks.registry import open_source
from capture_proxy.testing.fake_vllm import Fault, Turn, serve_fake
from tests.support import ROOT
from tests.support.proxy_harness import chat_body, user
from tests.support.reliability_workers import Spawned, start_proxy

#: The call the proxy is killed in: the fake vLLM never answers it. A slow answer instead (a fixed
#: latency) raced the kill: on a loaded machine the claim took longer to show than the answer
#: took to come, and the call was staged before the kill.
IN_FLIGHT = "killed while upstream"


def _hang_in_flight(body: dict[str, Any]) -> Turn:
    last = body["messages"][-1]["content"]
    return Turn(fault=Fault.hang()) if last == IN_FLIGHT else Turn("an answer")


async def _call(base: str, text: str) -> tuple[str, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{base}/r/r1/v1/chat/completions", json=chat_body(user(text))) as resp,
    ):
        await resp.read()
        return resp.headers["X-Capture-Status"], resp.headers["X-Capture-Call-Id"]


def _proxy(upstream: str, url: str) -> Spawned:
    p = start_proxy(upstream, url, "--min-free-disk-mb", "0", cwd=ROOT)
    p.wait_ready()
    return p


def _claims(url: str) -> dict[int, str]:
    source = open_source(url)
    try:
        return source.claims("r1") if "r1" in source.rollouts() else {}
    finally:
        source.close_reader()


async def _until_claimed(url: str, n: int) -> dict[int, str]:
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        claims = await asyncio.to_thread(_claims, url)
        if len(claims) >= n:
            return claims
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {n} claims after 20s")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_call_in_flight_at_sigkill_is_lost_in_crash_after_restart(
    kind: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}" if kind == "sqlite" else f"parquet:///{tmp_path / 'ds'}"
    # In this process, so the test's loop must not block while a proxy starts or stops.
    _, runner, upstream = await serve_fake(script=_hang_in_flight)
    try:
        first = await asyncio.to_thread(_proxy, upstream, url)
        try:
            assert (await _call(first.url, "before"))[0] == "staged"
            in_flight = asyncio.ensure_future(_call(first.url, IN_FLIGHT))
            claims = await _until_claimed(url, 2)  # admitted, claimed, held upstream
            await asyncio.to_thread(first.kill)
        finally:
            first.kill()
        with pytest.raises(aiohttp.ClientError):
            await in_flight
        lost = claims[1]

        second = await asyncio.to_thread(_proxy, upstream, url)
        try:
            status, after = await _call(second.url, "after the restart")
            assert status == "staged"
        finally:
            assert await asyncio.to_thread(second.terminate) == 0, second.output()
    finally:
        await runner.cleanup()
    with open_store(url) as store:
        source = store.source
        assert [s.seq for s in source.summaries("r1")] == [0, 2]
        assert source.claims("r1")[2] == after
        status_now = store.status("r1")
        assert status_now.poisoned
        assert [(n.seq, n.call_id, n.status) for n in status_now.not_staged] == [
            (1, lost, "lost_in_crash")
        ]
        store.verify()


async def _metrics_head(base: str, claims: int) -> StoreHead:
    """The store head on the proxy's ``/metrics`` once it covers `claims` claim files."""
    deadline = time.monotonic() + 20.0
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            (info,) = families["capture_proxy_store_head_info"].samples
            labels = info.labels
            if int(labels["claims"]) >= claims:
                return StoreHead(
                    labels["head"],
                    int(labels["rollouts"]),
                    int(labels["events"]),
                    int(labels["claims"]),
                )
            await asyncio.sleep(0.05)
    raise AssertionError(f"the store head never covered {claims} claim files")


@pytest.mark.slow
async def test_a_deleted_claim_file_of_a_call_in_flight_at_sigkill_is_caught_on_parquet(
    tmp_path: Path,
) -> None:
    """The claim file is the only trace of the call a SIGKILL cut (its event waits for the next
    unit): deleting it un-poisons the open rollout, and no per-rollout check can tell. The store
    head the killed proxy published on ``/metrics`` after the claim (what an operator's
    Prometheus keeps) catches it."""
    where = tmp_path / "ds"
    url = f"parquet:///{where}"
    _, runner, upstream = await serve_fake(script=_hang_in_flight)
    try:
        proxy = await asyncio.to_thread(_proxy, upstream, url)
        try:
            assert (await _call(proxy.url, "before"))[0] == "staged"
            in_flight = asyncio.ensure_future(_call(proxy.url, IN_FLIGHT))
            claims = await _until_claimed(url, 2)
            kept = await _metrics_head(proxy.url, 2)
            await asyncio.to_thread(proxy.kill)
        finally:
            proxy.kill()
        with pytest.raises(aiohttp.ClientError):
            await in_flight
    finally:
        await runner.cleanup()
    with open_store(url) as store:
        assert store.status("r1").poisoned
        store.verify(expected_store_head=kept.token())  # the honest crash: the head kept
    files = (where / "claims").rglob("*")
    (claim,) = [f for f in files if f.is_file() and claims[1].encode() in f.read_bytes()]
    claim.unlink()
    with open_store(url) as store:
        assert not store.status("r1").poisoned
        store.verify()
        with pytest.raises(StoreCorrupted, match="1 claim file\\(s\\) fewer"):
            store.verify(expected_store_head=kept.token())
