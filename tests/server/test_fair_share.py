"""Calls in flight shared fairly between rollouts once the proxy is busy (issue 27's soak).

A stream flood kept 16 calls in flight per rollout (``--max-inflight-per-rollout``) beside 32
agents making one call at a time: the proxy's loop relayed as many flood streams as honest calls.
With ``--fair-share-inflight``, past the threshold a rollout holding its share waits its turn while
a rollout with nothing in flight goes at once. Shown on the proxy as ``capture-proxy serve`` runs
it, in front of a fake vLLM that holds every generation until the test lets it go
(``FakeVLLM.running``), with raw-socket clients; no timing is asserted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from capture_proxy.server.fair_share import FairShare
from capture_proxy.server.state import STATE
from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.server.test_slow_clients import Served, answer_of, closed_within, head, served

Answer = tuple[int, dict[str, str], bytes]


def _body(rollout: str, n: int) -> bytes:
    text = f"{rollout} call {n}"
    return orjson.dumps({"model": "policy", "messages": [{"role": "user", "content": text}]})


async def _call(port: int, rollout: str, n: int) -> Answer:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        body = _body(rollout, n)
        writer.write(head(f"/r/{rollout}/v1/chat/completions", length=len(body)) + body)
        return await answer_of(reader, within=30)
    finally:
        writer.close()


async def _until(predicate: Callable[[], bool], within: float = 10) -> None:
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 (state in the proxy and the fake, no event)
            await asyncio.sleep(0.02)


def _forwarded(fake: FakeVLLM) -> list[str]:
    """The calls that reached the upstream, in order, by their message text."""
    return [r["messages"][-1]["content"] for r in fake.requests]


async def _flood_two_in_flight_one_waiting(s: Served, fake: FakeVLLM) -> list[asyncio.Task[Answer]]:
    """Two calls of rollout "flood" held upstream (the proxy at its threshold of 2), a third
    waiting its turn."""
    fair = s.listening.app[STATE].fair_share
    calls: list[asyncio.Task[Answer]] = []
    for n in range(3):
        calls.append(asyncio.create_task(_call(s.port, "flood", n)))
        if n < 2:
            await _until(lambda: len(fake.requests) == len(calls) == fair.in_flight)
    await _until(lambda: fair.waiting == 1)
    return calls


async def test_a_flooding_rollout_waits_its_turn_while_a_rollout_with_none_in_flight_goes_at_once(
    tmp_path: Path,
) -> None:
    fake = FakeVLLM()
    fake.running.clear()  # every generation held until the test lets them go
    async with served(tmp_path, fake, fair_share_inflight=2) as s:
        flood = await _flood_two_in_flight_one_waiting(s, fake)
        assert _forwarded(fake) == ["flood call 0", "flood call 1"]
        # The agent with nothing in flight is not queued behind the flood: it reaches vLLM now,
        # while the flood's third call still waits without its body read.
        honest = asyncio.create_task(_call(s.port, "agent", 0))
        await _until(lambda: len(fake.requests) == 3)
        assert _forwarded(fake)[2] == "agent call 0"
        assert s.listening.app[STATE].fair_share.waiting == 1
        fake.running.set()
        answers = [await t for t in (*flood, honest)]
        assert [a[0] for a in answers] == [200, 200, 200, 200]
        # The waiting call went once a turn was free: nothing refused, every call staged.
        assert _forwarded(fake)[3] == "flood call 2"
        assert s.failures("flood") == []
        assert len(s.staged("flood")) == 3
        assert len(s.staged("agent")) == 1
        metrics = await _scrape(s.port)
        assert "capture_proxy_fair_share_waited_total 1.0" in metrics
        assert "capture_proxy_fair_share_waiting 0.0" in metrics


async def test_a_rollout_whose_fair_share_queue_is_full_gets_429_and_its_connection_closed(
    tmp_path: Path,
) -> None:
    fake = FakeVLLM()
    fake.running.clear()
    async with served(
        tmp_path,
        fake,
        fair_share_inflight=2,
        fair_share_queue=1,
    ) as s:
        flood = await _flood_two_in_flight_one_waiting(s, fake)
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        body = _body("flood", 3)
        writer.write(head("/r/flood/v1/chat/completions", length=len(body)) + body)
        status, headers, answer = await answer_of(reader)
        assert status == 429
        error = orjson.loads(answer)["error"]
        assert error["code"] == "rollout_over_fair_share"
        assert "--fair-share-inflight 2" in error["message"]
        assert headers["retry-after"] == "1"
        assert headers["x-capture-status"] == "rejected"
        # Its next call comes on a new connection, judged at accept by its address's rate.
        assert headers["connection"] == "close"
        assert await closed_within(reader, within=5) == b""
        writer.close()
        fake.running.set()
        assert [(await t)[0] for t in flood] == [200, 200, 200]
        # The refusal is in the rollout's ledger with its call id; it never reached vLLM.
        [refused] = s.failures("flood")
        assert refused.reason == "rollout_over_fair_share"
        assert refused.call_id == headers["x-capture-call-id"]
        assert "flood call 3" not in _forwarded(fake)
        assert len(s.staged("flood")) == 3
        assert "capture_proxy_fair_share_refused_total 1.0" in await _scrape(s.port)


async def test_a_call_that_waits_longer_than_the_fair_share_wait_gets_429_with_retry_after(
    tmp_path: Path,
) -> None:
    fake = FakeVLLM()
    fake.running.clear()
    async with served(
        tmp_path,
        fake,
        fair_share_inflight=2,
        fair_share_wait=0.2,
    ) as s:
        flood = await _flood_two_in_flight_one_waiting(s, fake)
        status, headers, answer = await flood[2]
        assert status == 429
        assert orjson.loads(answer)["error"]["code"] == "rollout_over_fair_share"
        assert "waited 0.2s" in orjson.loads(answer)["error"]["message"]
        assert headers["retry-after"] == "1"
        assert s.listening.app[STATE].fair_share.waiting == 0
        fake.running.set()
        assert [(await t)[0] for t in flood[:2]] == [200, 200]
        assert [f.reason for f in s.failures("flood")] == ["rollout_over_fair_share"]
        assert _forwarded(fake) == ["flood call 0", "flood call 1"]


async def test_a_waiting_call_whose_client_leaves_is_never_forwarded_and_frees_its_place(
    tmp_path: Path,
) -> None:
    fake = FakeVLLM()
    fake.running.clear()
    async with served(tmp_path, fake, fair_share_inflight=2) as s:
        fair = s.listening.app[STATE].fair_share
        flood = await _flood_two_in_flight_one_waiting(s, fake)
        flood[2].cancel()  # the client closes its connection while its call waits
        await _until(lambda: fair.waiting == 0)
        fake.running.set()
        assert [(await t)[0] for t in flood[:2]] == [200, 200]
        await _until(lambda: fair.in_flight == 0)
        assert _forwarded(fake) == ["flood call 0", "flood call 1"]
        # The rollout's next call goes as usual.
        assert (await _call(s.port, "flood", 4))[0] == 200
        assert len(s.staged("flood")) == 3


async def test_with_fair_sharing_off_a_rollout_keeps_as_many_calls_in_flight_as_its_limit(
    tmp_path: Path,
) -> None:
    fake = FakeVLLM()
    fake.running.clear()
    async with served(
        tmp_path,
        fake,
        fair_share_inflight=0,
        max_inflight_per_rollout=4,
    ) as s:
        calls = [asyncio.create_task(_call(s.port, "flood", n)) for n in range(4)]
        await _until(lambda: len(fake.requests) == 4)
        assert s.listening.app[STATE].fair_share.waiting == 0
        fake.running.set()
        assert [(await t)[0] for t in calls] == [200] * 4


async def _scrape(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: proxy\r\n\r\n")
        return (await answer_of(reader))[2].decode()
    finally:
        writer.close()


# -- the turns themselves (no HTTP: the order in which waiting rollouts go) ---------------------


async def _waiting(fair: FairShare, rollout: str) -> asyncio.Task[None]:
    task = asyncio.create_task(fair.turn(rollout))
    await _until(lambda: any(rollout == r for r in fair._waiting))
    return task


async def test_the_waiting_rollout_with_the_fewest_calls_in_flight_goes_first() -> None:
    fair = FairShare(threshold=4, queue=4, wait_s=30)
    # "a" holds 3 calls, "b" 2 (share: 4 over 2 rollouts = 2): the proxy is over its threshold.
    for rollout in ("a", "a", "a", "b", "b"):
        await fair.turn(rollout)
    b = await _waiting(fair, "b")  # waits first
    a = await _waiting(fair, "a")
    # A rollout with nothing in flight goes at once, over the threshold.
    await fair.turn("c")
    fair.release("c")
    await asyncio.sleep(0)
    assert not a.done()
    assert not b.done()
    fair.release("a")  # "a" 2, "b" 2, the proxy at 4: both hold their share, neither goes
    await asyncio.sleep(0)
    assert not a.done()
    assert not b.done()
    fair.release("a")  # "a" 1: the fewest in flight goes first, though "b" waited longer
    await asyncio.sleep(0)
    assert a.done()
    assert not b.done()
    fair.release("b")  # "b" 1: now it has the fewest
    await asyncio.sleep(0)
    assert b.done()
    assert fair.in_flight == 4
    assert fair.waiting == 0


@pytest.mark.parametrize("threshold", [0, 100])
async def test_under_the_threshold_or_switched_off_no_call_waits(threshold: int) -> None:
    fair = FairShare(threshold=threshold, queue=1, wait_s=30)
    for _ in range(50):
        await fair.turn("a")
    assert fair.in_flight == 50
    assert fair.waiting == 0
