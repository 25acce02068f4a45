"""The batch API through a proxy: a trainer on another host (``open_store("http://...",
token=reader)``, a synchronous client on a thread) blocked on ``POST
/admin/store/batches/{consumer}/next`` while a driver runs rollouts through the proxy, in front
of the bundled fake vLLM, both real servers on loopback; the consumer's place outlives a
restart of the trainer and of the proxy."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.read.reader import Store, open_store
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.registry import open_sink
from capture_proxy.testing.fake_vllm import Fault, Turn
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user

ADMIN_TOKEN = "admin-token-for-batches-0123"
READER_TOKEN = "reader-token-for-batches-4567"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
READER = {"Authorization": f"Bearer {READER_TOKEN}"}


@pytest.fixture(params=["sqlite", "parquet"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'served.db'}"
    return f"parquet:///{tmp_path}/pq"


@pytest.fixture(params=["remote", "local"])
def trainer(request: pytest.FixtureRequest) -> str:
    """Where the trainer reads: through the proxy's routes, or the store's files directly."""
    return str(request.param)


def open_for(url: str) -> Store:
    """The trainer's store: a proxy's with the reader token, or a store by its own URL."""
    return open_store(url, token=READER_TOKEN if url.startswith("http") else None)


async def serve(tmp_path: Path, store_url: str, name: str = "p") -> Proxy:
    return await start_proxy(
        tmp_path / name,
        sink=open_sink(store_url),
        admin_token=ADMIN_TOKEN,
        reader_token=READER_TOKEN,
    )


def url_of(p: Proxy) -> str:
    return str(p.client.make_url("")).rstrip("/")


async def rollout(
    p: Proxy, rollout_id: str, *, group: str | None, seal: bool = True, grade: bool = True
) -> None:
    """What a driver does: create, two turns, seal, and the grader's outcome."""
    created = await p.client.post("/admin/rollouts", json={"rollout_id": rollout_id}, headers=ADMIN)
    assert created.status == 201
    messages: list[dict[str, Any]] = [user(f"task {rollout_id}")]
    for turn in range(2):
        resp = await p.chat(chat_body(*messages, max_tokens=8), rollout=rollout_id)
        assert resp.headers["X-Capture-Status"] == "staged"
        answer = (await resp.json())["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, user(f"go on {turn}")]
    if seal:
        assert (
            await p.client.post(f"/admin/rollouts/{rollout_id}/seal", headers=ADMIN)
        ).status == 200
    if grade:
        outcome = {"reward": 1.0, "group_id": group} if group else {"reward": 0.0}
        put = await p.client.put(
            f"/admin/rollouts/{rollout_id}/outcome", json=outcome, headers=ADMIN
        )
        assert put.status == 200, await put.text()


def take(
    url: str, consumer: str, groups: int, *, until: float
) -> tuple[list[str], list[str], dict[str, str]]:
    """A trainer: takes batches of one complete group of two until `groups` arrived (or time
    runs out), restarting (a new client, the third batch not acknowledged) once on the way.
    Returns the group ids received in order, the batch ids seen redelivered, and the rollouts
    its batches said were skipped (with why)."""
    got: list[str] = []
    redelivered: list[str] = []
    skipped: dict[str, str] = {}
    restarted = False
    store = open_for(url)
    try:
        while len(got) < groups and time.monotonic() < until:
            batch = store.next_batch(consumer, groups=1, group_size=2, wait_s=2)
            if batch is None:
                continue
            assert all(t.calls for t in batch.trajectories)  # read and verified here
            skipped.update((s.rollout_id, s.reason) for s in batch.skipped)
            if batch.redelivered:
                redelivered.append(batch.batch_id)
            else:
                got.extend(batch.plan.groups)
            if len(got) == 3 and not restarted:
                restarted = True  # crashed before its ack: a new client, the same batch
                store.close()
                store = open_for(url)
                continue
            batch.ack()
    finally:
        store.close()
    return got, redelivered, skipped


async def test_a_trainer_blocked_on_batches_receives_every_graded_group_once_while_a_load_runs(
    tmp_path: Path, store_url: str, trainer: str
) -> None:
    p = await serve(tmp_path, store_url)
    try:
        groups = [f"g{i}" for i in range(6)]

        async def drive() -> None:
            # Two sandboxes per group at once, groups one after another; plus rollouts a
            # trainer must not get: one never graded, one never sealed, one without a group.
            for g in groups:
                await asyncio.gather(*(rollout(p, f"{g}-{k}", group=g) for k in range(2)))
                await asyncio.sleep(0.05)
            await rollout(p, "ungraded", group=None, grade=False)
            await rollout(p, "unsealed", group="gx", seal=False)
            await rollout(p, "nogroup", group=None)

        url = url_of(p) if trainer == "remote" else store_url
        taking = asyncio.create_task(
            asyncio.to_thread(take, url, "trainer", len(groups), until=time.monotonic() + 60)
        )
        await drive()
        got, redelivered, skipped = await taking
        assert sorted(got) == groups  # each graded group once
        assert len(redelivered) == 1  # the batch of the trainer's restart, once
        # Nothing left for the trainer, and its place says so.
        position = await p.client.get("/admin/store/batches/trainer", headers=READER)
        assert position.status == 200
        assert (await position.json())["taken"] == 12
        nxt = await p.client.post(
            "/admin/store/batches/trainer/next",
            json={"groups": 1, "group_size": 2, "wait_s": 0.3},
            headers=READER,
        )
        assert nxt.status == 200
        assert await nxt.json() == {"batch": None}
        # What the trainer will never get is said once, with why: in a batch, or (sealed after
        # its last batch) in its place until the next one.
        position = await p.client.get("/admin/store/batches/trainer", headers=READER)
        skipped.update((s["rollout_id"], s["reason"]) for s in (await position.json())["skipped"])
        assert skipped == {"nogroup": "no_group"}
    finally:
        await stop_proxy(p)


async def test_the_consumer_cursor_outlives_a_proxy_restart(
    tmp_path: Path, store_url: str, trainer: str
) -> None:
    p = await serve(tmp_path, store_url, "first")
    try:
        for i in range(3):
            await rollout(p, f"r{i}", group=f"g{i}")
        url = url_of(p) if trainer == "remote" else store_url

        def first_run() -> str:
            with open_for(url) as store:
                one = store.next_batch("t", rollouts=1, wait_s=5)
                assert one is not None
                assert one.rollout_ids == ("r0",)
                one.ack()
                two = store.next_batch("t", rollouts=1, wait_s=5)
                assert two is not None
                return two.batch_id  # not acknowledged: the proxy goes down

        pending = await asyncio.to_thread(first_run)
    finally:
        await stop_proxy(p)
    q = await serve(tmp_path, store_url, "second")
    try:
        url = url_of(q) if trainer == "remote" else store_url

        def second_run() -> list[str]:
            with open_for(url) as store:
                again = store.next_batch("t", rollouts=1, wait_s=5)
                assert again is not None
                assert (again.batch_id, again.rollout_ids, again.redelivered) == (
                    pending,
                    ("r1",),
                    True,
                )
                again.ack()
                last = store.next_batch("t", rollouts=1, wait_s=5)
                assert last is not None
                last.ack()
                assert store.next_batch("t", rollouts=1, wait_s=0.3) is None
                return [*again.rollout_ids, *last.rollout_ids]

        assert await asyncio.to_thread(second_run) == ["r1", "r2"]
    finally:
        await stop_proxy(q)


async def test_index_filters_are_evaluated_on_the_proxy(tmp_path: Path, store_url: str) -> None:
    p = await serve(tmp_path, store_url)
    try:
        await rollout(p, "a", group="A")
        await rollout(p, "b", group="B")
        await rollout(p, "open", group=None, seal=False, grade=False)
        got = await p.client.get("/admin/store/rollouts?state=sealed&group=B", headers=READER)
        assert await got.json() == ["b"]
        got = await p.client.get("/admin/store/rollouts?group=A&group=B", headers=READER)
        assert await got.json() == ["a", "b"]
        got = await p.client.get("/admin/store/rollouts?state=open", headers=READER)
        assert await got.json() == ["open"]
        rows = await (await p.client.get("/admin/store/index?graded=true", headers=READER)).json()
        assert [(r["rollout_id"], r["group_id"], r["state"]) for r in rows] == [
            ("a", "A", "sealed"),
            ("b", "B", "sealed"),
        ]
        bad = await p.client.get("/admin/store/rollouts?state=closed", headers=READER)
        assert bad.status == 422
        assert "state must be open, sealed or poisoned" in (await bad.json())["error"]["message"]
        bad = await p.client.get("/admin/store/rollouts?since=yesterday", headers=READER)
        assert bad.status == 422
        assert (await bad.json())["error"]["param"] == "since"

        def remote() -> tuple[list[str], list[str]]:
            with open_store(url_of(p), token=READER_TOKEN) as store:
                return store.rollouts(group="A"), store.rollouts(state="sealed", graded=True)

        assert await asyncio.to_thread(remote) == (["a"], ["a", "b"])
    finally:
        await stop_proxy(p)


async def test_the_batch_routes_answer_with_their_statuses(tmp_path: Path, store_url: str) -> None:
    p = await serve(tmp_path, store_url)
    try:
        await rollout(p, "a", group="A")
        nxt = "/admin/store/batches/t/next"
        assert (await p.client.post(nxt, json={"rollouts": 1})).status == 401
        refused = await p.client.post(nxt, json={"rollouts": 1, "groups": 1}, headers=READER)
        assert refused.status == 422
        assert "one of the two" in (await refused.json())["error"]["message"]
        refused = await p.client.post(nxt, json={"rollouts": 1, "wait_s": 31}, headers=READER)
        assert refused.status == 422
        refused = await p.client.post(
            "/admin/store/batches/bad%20name/next", json={"rollouts": 1}, headers=READER
        )
        assert refused.status == 422
        started = time.monotonic()
        got = await p.client.post(nxt, json={"rollouts": 2, "wait_s": 0.5}, headers=READER)
        assert await got.json() == {"batch": None}
        assert time.monotonic() - started >= 0.5  # it waited, then said there was none
        got = await p.client.post(nxt, json={"rollouts": 1}, headers=READER)
        batch = (await got.json())["batch"]
        assert batch["rollout_ids"] == ["a"]
        ack = "/admin/store/batches/t/ack"
        unknown = await p.client.post(ack, json={"batch_id": "t:9"}, headers=READER)
        assert unknown.status == 409
        assert (await unknown.json())["error"]["code"] == "batch_unknown"
        done = await p.client.post(ack, json={"batch_id": batch["batch_id"]}, headers=READER)
        assert await done.json() == {"consumer": "t", "batch_id": "t:1", "acked": 1}

        def remote_refusal() -> str:
            with open_store(url_of(p), token=READER_TOKEN) as store:
                try:
                    store.source.ack_batch("t", "t:9")  # type: ignore[attr-defined]
                except StoreError as e:
                    return str(e)
            return ""

        assert "answered 409: consumer 't' was not handed batch 't:9'" in await asyncio.to_thread(
            remote_refusal
        )
    finally:
        await stop_proxy(p)


async def test_a_remote_trainer_is_told_why_it_skips_poisoned_and_stale_rollouts(
    tmp_path: Path, store_url: str
) -> None:
    p = await serve(tmp_path, store_url)
    try:
        await rollout(p, "old", group=None)  # stamped with version 0
        # A call answered but not staged: its rollout is poisoned.
        created = await p.client.post("/admin/rollouts", json={"rollout_id": "bad"}, headers=ADMIN)
        assert created.status == 201
        p.fake.push(Turn("lost", fault=Fault.drop_token_ids()))
        lost = await p.chat(chat_body(user("x")), rollout="bad")
        assert lost.headers["X-Capture-Status"] == "capture_failed"
        assert (await p.client.post("/admin/rollouts/bad/seal", headers=ADMIN)).status == 200
        graded = await p.client.put(
            "/admin/rollouts/bad/outcome", json={"reward": 1.0}, headers=ADMIN
        )
        assert graded.status == 200
        version = await p.client.put(
            "/admin/weight-version", json={"weight_version": 2}, headers=ADMIN
        )
        assert version.status == 200
        await rollout(p, "new", group=None)  # stamped with version 2

        def take() -> tuple[tuple[str, ...], int | None, dict[str, tuple[str, str]]]:
            with open_store(url_of(p), token=READER_TOKEN) as store:
                batch = store.next_batch("t", rollouts=1, max_staleness=1, wait_s=5)
                assert batch is not None
                skipped = {s.rollout_id: (s.reason, s.detail) for s in batch.skipped}
                return batch.rollout_ids, batch.plan.current_version, skipped

        ids, current, skipped = await asyncio.to_thread(take)
        assert ids == ("new",)
        assert current == 2  # the version the driver set, read from the proxy's store
        assert skipped["old"] == ("stale", "weight version 0 is older than 2 - 1")
        assert skipped["bad"][0] == "poisoned"
        assert "capture_failed: missing_token_ids" in skipped["bad"][1]
    finally:
        await stop_proxy(p)


async def test_a_remote_index_query_keeps_poisoned_rows_of_a_state_when_asked(
    tmp_path: Path, store_url: str
) -> None:
    p = await serve(tmp_path, store_url)
    try:
        await rollout(p, "a", group=None)
        created = await p.client.post("/admin/rollouts", json={"rollout_id": "bad"}, headers=ADMIN)
        assert created.status == 201
        p.fake.push(Turn("lost", fault=Fault.drop_token_ids()))
        await p.chat(chat_body(user("x")), rollout="bad")
        assert (await p.client.post("/admin/rollouts/bad/seal", headers=ADMIN)).status == 200
        await rollout(p, "b", group=None)

        def read() -> tuple[list[str], list[str]]:
            from capture_proxy.sinks.rollout_index import RolloutQuery, indexed

            with open_store(url_of(p), token=READER_TOKEN) as store:
                kept = indexed(store.source, RolloutQuery(state="sealed", with_poisoned=True))
                return [r.rollout_id for r in kept], store.rollouts(state="sealed")

        assert await asyncio.to_thread(read) == (["a", "bad", "b"], ["a", "b"])
    finally:
        await stop_proxy(p)
