"""A rollout handed to another proxy and back, on one store (a Parquet dataset on moto's S3
server, the only kind several proxies share): the proxy it comes back to still holds the
rollout's old state. Every call it answers leaves a trace in the store: its copy is read again
from the store and the call staged at the next free seq (or, for a call that was not staged,
its ledger entry written there), so the trainer reads every model turn the sandbox kept, or
learns the rollout is poisoned."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.read.reader import Store
from capture_proxy.read.status import RolloutExcluded
from capture_proxy.sinks.base import StagingSource
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.testing.fake_vllm import FakeVLLM, Fault, Turn
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user
from tests.support.s3 import MotoS3

TOKEN = "admin-token"


@asynccontextmanager
async def _two_proxies(
    tmp_path: Path, url: str, fake: FakeVLLM | None = None
) -> AsyncIterator[tuple[Proxy, Proxy]]:
    a = await start_proxy(
        tmp_path / "a", fake=fake, sink=open_sink(url), store=url, admin_token=TOKEN
    )
    b = await start_proxy(tmp_path / "b", sink=open_sink(url), store=url, admin_token=TOKEN)
    try:
        yield a, b
    finally:
        await stop_proxy(a)
        await stop_proxy(b)


class Sandbox:
    """An agent's conversation: each call sends the whole history, answers are kept in it."""

    def __init__(self, rollout: str) -> None:
        self.rollout = rollout
        self.messages: list[dict[str, Any]] = []
        self.statuses: list[str] = []

    async def turn(self, proxy: Proxy, text: str) -> None:
        self.messages.append(user(text))
        resp = await proxy.chat(chat_body(*self.messages), rollout=self.rollout)
        assert resp.status == 200, await resp.text()
        self.statuses.append(resp.headers["X-Capture-Status"])
        answer = (await resp.json())["choices"][0]["message"]
        self.messages.append({"role": "assistant", "content": answer["content"]})


@pytest.fixture
def store_url(moto_s3: MotoS3) -> str:
    # Several proxies share a dataset on object storage only: a SQLite file and a local
    # Parquet folder each keep one writer at a time (a lock).
    return moto_s3.url()


async def test_a_rollout_handed_back_to_a_stale_proxy_stages_every_answered_call(
    tmp_path: Path, store_url: str
) -> None:
    sandbox = Sandbox("ep")
    async with _two_proxies(tmp_path, store_url) as (two, one):
        for i in range(3):  # seqs 0-2 on proxy 2, which keeps the rollout in memory
            await sandbox.turn(two, f"on two {i}")
        for i in range(4):  # the sandbox moves to proxy 1: seqs 3-6
            await sandbox.turn(one, f"on one {i}")
        for i in range(4):  # and back to proxy 2, whose copy still says the next seq is 3
            await sandbox.turn(two, f"back on two {i}")
        metrics = await (await two.client.get("/metrics")).text()
    assert sandbox.statuses == ["staged"] * 11
    # Proxy 2 said what it did: its first call back moved to the next free seq, counted.
    assert "capture_proxy_stale_rollout_moves_total 1.0" in metrics
    with Store(open_source(store_url)) as store:
        store.verify()
        traj = store.trajectory("ep", include_open=True)
        calls = store.calls("ep", include_open=True)
    assert [c.seq for c in calls] == list(range(11))
    assert not traj.poisoned
    assert traj.not_staged == []
    # Every model turn the sandbox kept is a completion the trainer reads, none as prompt text.
    answers = [m["content"] for m in sandbox.messages if m["role"] == "assistant"]
    assert [c.response["content"] for c in calls] == answers
    # Each call continues the one before it, across both hand-offs (the fake vLLM's plain path
    # re-tokenizes history, so its trajectories break at every call for ``drift`` alone).
    assert [c.parent_call_id for c in calls[1:]] == [c.call_id for c in calls[:-1]]
    assert {b.reason for b in traj.breaks} == {"drift"}


async def test_calls_that_fail_on_a_stale_proxy_are_in_the_ledger_and_poison_the_rollout(
    tmp_path: Path, store_url: str
) -> None:
    """A call the stale proxy answered without a record (its token ids missing), and one its
    upstream failed, are in the rollout's ledger at free seqs (the store refused their old
    seqs): the answered one poisons the rollout, and a trainer's reads skip it and say why."""
    sandbox = Sandbox("ep")
    async with _two_proxies(tmp_path, store_url) as (two, one):
        for i in range(2):
            await sandbox.turn(two, f"on two {i}")
        for i in range(2):
            await sandbox.turn(one, f"on one {i}")
        two.fake.push(Turn("answered, never staged", fault=Fault.drop_token_ids()))
        await sandbox.turn(two, "back on two")
        two.fake.push(Turn("", fault=Fault.http_error(500)))
        sandbox.messages.append(user("the upstream fails"))
        failed = await two.chat(chat_body(*sandbox.messages), rollout="ep")
        assert (failed.status, failed.headers["X-Capture-Status"]) == (500, "upstream_error")
        sandbox.messages.pop()
        await sandbox.turn(two, "once more")
    assert sandbox.statuses == ["staged"] * 4 + ["capture_failed", "staged"]
    with Store(open_source(store_url)) as store:
        store.verify()
        with pytest.raises(RolloutExcluded, match=r"poisoned.*capture_failed: missing_token_ids"):
            store.trajectory("ep", include_open=True)
        traj = store.trajectory("ep", include_open=True, include_poisoned=True)
        failures = store.source.failures("ep")
        staged = [c.seq for c in store.calls("ep", include_open=True, include_poisoned=True)]
    assert traj.poisoned
    assert [(n.seq, n.status) for n in traj.not_staged] == [
        (4, "capture_failed"),
        (5, "upstream_error"),
    ]
    assert sorted((f.seq, f.status) for f in failures) == [
        (4, "capture_failed"),
        (5, "upstream_error"),
    ]
    assert staged == [0, 1, 2, 3, 6]
    # The lost answer is prompt text of the next call: the trajectory starts a new segment there.
    assert len(traj.segments) == len(staged)


async def test_a_stale_proxy_that_cannot_read_the_store_holds_the_entry_until_it_can(
    tmp_path: Path, store_url: str
) -> None:
    """The stale proxy's reads of the store fail when its call is refused its seq: the call is
    ``capture_failed`` (``duplicate_seq``) and its ledger entry is held in memory (``/readyz``
    says so), not dropped; once the store can be read it is written at a free seq, poisoning
    the rollout. (The reads fail by the proxy's reader opener being swapped for one that
    raises; the store and its files are the real ones.)"""
    sandbox = Sandbox("ep")
    async with _two_proxies(tmp_path, store_url) as (two, one):
        await sandbox.turn(two, "on two")
        await sandbox.turn(one, "on one")
        capture = two.state.capture
        reader = capture.source

        def unreachable() -> StagingSource:
            raise OSError("the store is unreachable")

        capture.source = unreachable
        await sandbox.turn(two, "back on two")
        assert sandbox.statuses[-1] == "capture_failed"
        assert len(capture.ledger.held) == 1
        ready = await two.client.get("/readyz")
        assert ready.status == 503
        assert "1 ledger entries held in memory" in await ready.text()
        capture.source = reader
        # The proxy's guard flushes held entries every second.
        for _ in range(50):
            if not capture.ledger.held:
                break
            await asyncio.sleep(0.1)
        assert not capture.ledger.held
    with Store(open_source(store_url)) as store:
        store.verify()
        traj = store.trajectory("ep", include_open=True, include_poisoned=True)
    assert traj.poisoned
    assert [(n.seq, n.status, n.reason) for n in traj.not_staged] == [
        (2, "capture_failed", "duplicate_seq")
    ]


def _slow_answers(request: dict[str, Any]) -> Turn:
    # The title call's answer comes last: it is still in flight when the turn's call, refused
    # its seq, reads the rollout again (its own claim, accepted, is in the store by then).
    text = str(request["messages"])
    seconds = 1.5 if "a title" in text else 0.3 if "back on two" in text else 0.0
    return Turn("an answer", fault=Fault.delay_first_byte(seconds) if seconds else None)


async def test_concurrent_calls_on_a_stale_proxy_all_stage_and_the_sealed_rollout_is_clean(
    tmp_path: Path, store_url: str
) -> None:
    """Two calls at once on the stale proxy (an agent's title call beside its turn): the first
    is refused its seq, the second claims a free one; the first, read again from the store,
    moves on after the second's claim without taking it for a call lost in a crash. Sealed
    there, the rollout is not poisoned and a trainer reads all of it."""
    sandbox = Sandbox("ep")
    async with _two_proxies(tmp_path, store_url, FakeVLLM(script=_slow_answers)) as (two, one):
        for i in range(2):
            await sandbox.turn(two, f"on two {i}")
        await sandbox.turn(one, "on one")  # seq 2; proxy 2 still says 2 is next
        turn = asyncio.ensure_future(sandbox.turn(two, "back on two"))  # seq 2: refused
        await asyncio.sleep(0.1)
        titled = await two.chat(chat_body(user("a title for this session")), rollout="ep")
        await turn
        assert titled.headers["X-Capture-Status"] == "staged"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        sealed = await two.client.post("/admin/rollouts/ep/seal", headers=auth)
        assert sealed.status == 200, await sealed.text()
    assert sandbox.statuses == ["staged"] * 4
    with Store(open_source(store_url)) as store:
        store.verify()
        assert not store.rollout_info("ep").poisoned
        calls = store.calls("ep")  # sealed, not poisoned: the default filters take it
    assert sorted(c.seq for c in calls) == list(range(5))
