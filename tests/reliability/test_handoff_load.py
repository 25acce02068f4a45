"""Hand-offs under load on one object-store dataset (a Parquet dataset on moto's S3 server):
a rollout moved to a proxy that is busy with other rollouts. The store reads a hand-off needs
(the rollout's claims, its event chain, its last call's tokens) are made before the call's
writes are queued, within ``--rollout-resume-timeout``, never on the writer thread: so the
other rollouts' calls, queued on that writer, never wait for them, and none of them, nor the
moved call, fails at ``--stage-timeout`` (which would poison its rollout).

The proxy's reader is made busy the way a store under load makes it (a follower's re-listing or
a resume indexing other proxies' units held it for up to 6.7 s on moto,
docs/reports/handoffs.md): a thread holds a refresh of it under way (the reader's refresh lock:
reads wait for a refresh under way, since each reads a listing at least as new as itself)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeGuard

import pytest

from capture_proxy.read.reader import Store
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.testing.fake_vllm import FakeVLLM, Fault, Turn
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user
from tests.support.s3 import MotoS3

#: Short, so a call stuck behind a store read shows within the test.
STAGE_TIMEOUT = 2.0
#: How long the busy proxy's reader is held: past the stage timeout.
BUSY_S = 4.0


class Sandbox:
    """An agent's conversation; a 503 with Retry-After is sent again, as the agents do."""

    def __init__(self, rollout: str) -> None:
        self.rollout = rollout
        self.messages: list[dict[str, Any]] = []
        self.statuses: list[str] = []
        self.refusals: list[str] = []

    async def turn(self, proxy: Proxy, text: str) -> None:
        self.messages.append(user(text))
        for _ in range(20):
            resp = await proxy.chat(chat_body(*self.messages), rollout=self.rollout)
            body = await resp.json()
            if resp.status != 503:
                break
            self.refusals.append(body["error"]["code"])
            await asyncio.sleep(0.2)
        assert resp.status == 200, body
        self.statuses.append(resp.headers["X-Capture-Status"])
        self.messages.append(
            {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
        )


def _slow_hand_off(request: dict[str, Any]) -> Turn:
    # The moved call's answer takes a while: its record is staged while the reader is busy.
    slow = "moved in" in str(request["messages"][-1])
    return Turn("an answer", fault=Fault.delay_first_byte(1.0) if slow else None)


@contextmanager
def _busy_reader(proxy: Proxy, seconds: float) -> Iterator[None]:
    """Hold a refresh of the proxy's own reader under way for `seconds`, in a thread."""
    sink = proxy.sink
    assert isinstance(sink, ParquetSink)
    source = sink.own_source()
    assert isinstance(source, ParquetSource)
    held = threading.Event()

    def hold() -> None:
        with source._refreshing:
            held.set()
            time.sleep(seconds)

    thread = threading.Thread(target=hold, name="busy-reader")
    thread.start()
    held.wait()
    try:
        yield
    finally:
        thread.join()


def _parquet(sink: object) -> TypeGuard[ParquetSink]:
    return isinstance(sink, ParquetSink)


def _stage_timeouts(metrics: str) -> float:
    found = re.search(
        r'capture_proxy_calls_total\{outcome="capture_failed",reason="stage_timeout"\} (\S+)',
        metrics,
    )
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def store_url(moto_s3: MotoS3) -> str:
    return moto_s3.url()


async def test_a_hand_off_to_a_busy_proxy_holds_up_no_call_and_poisons_no_rollout(
    tmp_path: Path, store_url: str
) -> None:
    a = await start_proxy(tmp_path / "a", sink=open_sink(store_url), store=store_url)
    b = await start_proxy(
        tmp_path / "b",
        fake=FakeVLLM(script=_slow_hand_off),
        sink=open_sink(store_url),
        store=store_url,
        stage_timeout=STAGE_TIMEOUT,
    )
    moved = Sandbox("moved")
    steady = [Sandbox(f"steady-{i}") for i in range(4)]
    try:
        for sandbox in steady:  # rollouts proxy b holds
            await sandbox.turn(b, "on b")
        for i in range(2):  # seqs 0-1 on proxy a
            await moved.turn(a, f"on a {i}")
        hand_off = asyncio.ensure_future(moved.turn(b, "moved in"))  # seq 2, on proxy b
        for _ in range(100):  # proxy b has read the rollout back from the store
            if "moved" in b.state.capture.rollouts:
                break
            await asyncio.sleep(0.02)
        with _busy_reader(b, BUSY_S):
            # While the moved call is answered and staged, the other rollouts call on: twice
            # each, as long as the reader is busy.
            for turn in range(2):
                await asyncio.gather(*(s.turn(b, f"steady {turn}") for s in steady))
        await hand_off
        await moved.turn(b, "on b again")  # seq 3
        await moved.turn(a, "back on a")  # seq 4: a hand-back to a stale proxy
        metrics = await (await b.client.get("/metrics")).text()
        sinks = [a.sink, b.sink]
        in_writer = [s.stats()["writer_thread_resolves_total"] for s in sinks if _parquet(s)]
    finally:
        await stop_proxy(a)
        await stop_proxy(b)
    assert _stage_timeouts(metrics) == 0
    # No read of a rollout a writer did not hold (the hand-off to b, the hand-back to a) was
    # made on its thread.
    assert in_writer == [0, 0]
    assert moved.statuses == ["staged"] * 5
    assert all(s.statuses == ["staged"] * 3 for s in steady)
    with Store(open_source(store_url)) as store:
        store.verify()
        for sandbox in [moved, *steady]:
            traj = store.trajectory(sandbox.rollout, include_open=True)
            calls = store.calls(sandbox.rollout, include_open=True)
            assert not traj.poisoned
            assert traj.not_staged == []
            # Every answered call, at consecutive seqs: the trainer reads each model turn the
            # sandbox kept as a completion, none as prompt text.
            assert [c.seq for c in calls] == list(range(len(sandbox.statuses)))
            answers = [m["content"] for m in sandbox.messages if m["role"] == "assistant"]
            assert [c.response["content"] for c in calls] == answers
            assert [c.parent_call_id for c in calls[1:]] == [c.call_id for c in calls[:-1]]


async def test_a_hand_off_whose_store_reads_outlast_the_resume_bound_is_a_503_then_clean(
    tmp_path: Path, store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The moved rollout's reads (the resume and the writer's own, made together) wait for a
    busy reader past ``--rollout-resume-timeout``: its call is refused with 503
    ``rollout_resume_timeout``, logged and counted, before anything is sent upstream or any seq
    taken; the retry is staged, and the rollout reads clean. The calls of the rollouts the
    proxy holds go on meanwhile."""
    a = await start_proxy(tmp_path / "a", sink=open_sink(store_url), store=store_url)
    b = await start_proxy(
        tmp_path / "b",
        sink=open_sink(store_url),
        store=store_url,
        stage_timeout=STAGE_TIMEOUT,
        rollout_resume_timeout=1.0,
    )
    moved, steady = Sandbox("moved"), Sandbox("steady")
    try:
        await steady.turn(b, "on b")
        await moved.turn(a, "on a")
        with _busy_reader(b, BUSY_S):
            hand_off = asyncio.ensure_future(moved.turn(b, "moved in"))
            for i in range(3):
                await steady.turn(b, f"steady {i}")
            await hand_off
        metrics = await (await b.client.get("/metrics")).text()
    finally:
        await stop_proxy(a)
        await stop_proxy(b)
    assert moved.refusals
    assert set(moved.refusals) == {"rollout_resume_timeout"}
    assert "rollout moved: reading it from the store took over 1s" in caplog.text
    timeouts = re.search(r"^capture_proxy_rollout_resume_timeouts_total (\S+)", metrics, re.M)
    assert timeouts is not None
    assert float(timeouts.group(1)) == len(moved.refusals)
    assert _stage_timeouts(metrics) == 0
    assert (moved.statuses, steady.statuses) == (["staged"] * 2, ["staged"] * 4)
    # The refused calls never went upstream.
    assert sum("moved in" in str(r["messages"][-1]) for r in b.fake.requests) == 1
    with Store(open_source(store_url)) as store:
        store.verify()
        for sandbox in (moved, steady):
            traj = store.trajectory(sandbox.rollout, include_open=True)
            calls = store.calls(sandbox.rollout, include_open=True)
            assert not traj.poisoned
            assert traj.not_staged == []
            assert [c.seq for c in calls] == list(range(len(sandbox.statuses)))
