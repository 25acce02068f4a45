"""Several vLLM replicas behind one proxy, each a real fake vLLM server on loopback.

A rollout sticks to one replica (recorded as its records' `replica`, kept across a restart
through its event log); a replica that goes away gives its rollouts a 503 or, with
``--on-replica-loss move``, moves them (a `replica_moved` break and a `replica` event); a replica
serving another model is quarantined at first contact; per-replica metrics; weight routes reach
every healthy replica.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.events import EventKind
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import chat_body, stop_proxy, user
from tests.support.replicas import Fleet, OtherTemplate, call, replicas_of, start_fleet_proxy, until

TOKEN = "admin-token-for-replicas-0123"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


class FailingPush(FakeVLLM):
    """A dev-mode fake whose ``/update_weight_version`` fails."""

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"error": "weights are being loaded"}, status=500)


class FailingPause(FakeVLLM):
    """A dev-mode fake whose ``/pause`` fails."""

    async def _pause(self, request: web.Request) -> web.Response:
        return web.json_response({"error": "engine busy"}, status=500)


def _records(store_url: str, rollout: str) -> list[Any]:
    src = open_source(store_url)
    try:
        return src.calls(rollout)
    finally:
        src.close_reader()


def _events(store_url: str, rollout: str) -> list[Any]:
    src = open_source(store_url)
    try:
        return [e for e in src.events(rollout) if e.kind == EventKind.REPLICA]
    finally:
        src.close_reader()


async def test_a_rollout_sticks_to_one_replica_and_records_it(tmp_path: Path, fleet: Fleet) -> None:
    a, b = await fleet.add(), await fleet.add()
    p = await start_fleet_proxy(tmp_path, fleet)
    try:
        for rollout in ("r1", "r2", "r3", "r4"):
            for turn in range(3):
                resp = await call(p, rollout, f"turn {turn}")
                assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
        pinned = {}
        for rollout in ("r1", "r2", "r3", "r4"):
            replicas = {r.replica for r in p.calls(rollout)}
            assert len(replicas) == 1  # every call of the rollout on one replica
            pinned[rollout] = replicas.pop()
            assert [e.body for e in _events(p.store_url, rollout)] == [{"replica": pinned[rollout]}]
        # Least loaded first: the four rollouts are spread two and two.
        assert sorted(pinned.values()) == sorted([a, a, b, b])
        assert fleet.served_by(a) == fleet.served_by(b) == 6
    finally:
        await stop_proxy(p)


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_restarted_proxy_keeps_each_rollouts_replica(
    tmp_path: Path, fleet: Fleet, kind: str
) -> None:
    await fleet.add()
    await fleet.add()
    url = f"sqlite:///{tmp_path / 'store.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/ds"
    p = await start_fleet_proxy(tmp_path, fleet, sink=open_sink(url))
    rollouts = [f"r{i}" for i in range(6)]
    for rollout in rollouts:
        assert (await call(p, rollout)).headers["X-Capture-Status"] == "staged"
    before = {r: _records(url, r)[0].replica for r in rollouts}
    await stop_proxy(p)
    # A new process on the same store, its replicas listed in the other order: the pins come
    # from the rollouts' event logs, not from choosing again.
    fleet.fakes = dict(reversed(list(fleet.fakes.items())))
    p = await start_fleet_proxy(tmp_path, fleet, sink=open_sink(url))
    try:
        for rollout in reversed(rollouts):
            assert (await call(p, rollout, "again")).headers["X-Capture-Status"] == "staged"
        assert {r: _records(url, r)[1].replica for r in rollouts} == before
        assert all(len(_events(url, r)) == 1 for r in rollouts)  # pinned once
    finally:
        await stop_proxy(p)


async def test_a_lost_replica_gives_its_rollouts_503_upstream_unavailable(
    tmp_path: Path, fleet: Fleet
) -> None:
    a, b = await fleet.add(), await fleet.add()
    p = await start_fleet_proxy(tmp_path, fleet)
    try:
        await call(p, "r1")
        pinned = p.calls("r1")[0].replica
        other = b if pinned == a else a
        await fleet.stop(pinned)
        # The first call finds it gone (recorded as an upstream error)...
        resp = await call(p, "r1", "after the loss")
        assert resp.status == 502
        assert resp.headers["X-Capture-Status"] == "upstream_error"
        # ...and from then on the rollout's calls are refused, naming the replica.
        resp = await call(p, "r1", "again")
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
        assert error["code"] == "upstream_unavailable"
        assert f"pinned to replica {pinned}, which is unreachable" in error["message"]
        assert "--on-replica-loss fail" in error["message"]
        failures = p.failures("r1")
        assert [(f.status, f.reason) for f in failures][-1] == (
            CallStatus.REJECTED,
            "upstream_unavailable",
        )
        # The proxy is not down: a new rollout goes to the healthy replica.
        resp = await call(p, "r2")
        assert resp.headers["X-Capture-Status"] == "staged"
        assert p.calls("r2")[0].replica == other
        ready = await (await p.client.get("/readyz")).json()
        assert ready["ready"] is True
        states = {r["replica"]: r["state"] for r in ready["replicas"]}
        assert states == {pinned: "unreachable", other: "healthy"}
        assert any(f"replica {pinned} is unreachable" in w for w in ready["warnings"])
        # Back up: the rollout continues on its replica.
        await fleet.start(pinned)
        await until(lambda: replicas_of(p).by_name[pinned].state == "healthy")
        resp = await call(p, "r1", "it is back")
        assert resp.headers["X-Capture-Status"] == "staged"
        assert [r.replica for r in p.calls("r1")] == [pinned, pinned]
    finally:
        await stop_proxy(p)


async def test_with_move_a_lost_replicas_rollout_moves_and_the_move_is_recorded(
    tmp_path: Path, fleet: Fleet
) -> None:
    a, b = await fleet.add(), await fleet.add()
    p = await start_fleet_proxy(tmp_path, fleet, on_replica_loss="move")
    try:
        history = [user("first")]
        resp = await p.chat(chat_body(*history), rollout="r1")
        answer = (await resp.json())["choices"][0]["message"]
        pinned = p.calls("r1")[0].replica
        other = b if pinned == a else a
        await fleet.stop(pinned)
        replay = {k: v for k, v in answer.items() if v is not None and k != "refusal"}
        history += [replay, user("second")]
        resp = await p.chat(chat_body(*history), rollout="r1")
        assert resp.headers["X-Capture-Status"] == "upstream_error"  # found gone
        resp = await p.chat(chat_body(*history), rollout="r1")
        assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
        assert [r.replica for r in p.calls("r1")] == [pinned, other]
        events = [e.body for e in _events(p.store_url, "r1")]
        assert events == [{"replica": pinned}, {"replica": other, "moved_from": pinned}]
        traj = open_store(p.store_url).trajectory("r1", include_open=True)
        moved = [b for b in traj.breaks if b.reason == "replica_moved"]
        assert len(moved) == 1
        assert traj.to_dict()["breaks"][-1]["detail"] == {
            "from_replica": pinned,
            "to_replica": other,
        }
    finally:
        await stop_proxy(p)


async def test_a_replica_serving_another_model_is_quarantined_at_first_contact(
    tmp_path: Path, fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await fleet.add(), await fleet.add()
    old = await fleet.add(FakeVLLM(version="0.31.0"))
    late = fleet.reserve(OtherTemplate())  # starts after the proxy
    with caplog.at_level(logging.INFO, logger="capture_proxy.replicas"):
        p = await start_fleet_proxy(tmp_path, fleet)
        try:
            await fleet.start(late)
            await until(lambda: replicas_of(p).by_name[late].state == "quarantined")
            rounds = 0
            replicas_of(p).probed.clear()
            while rounds < 3:  # several probe rounds: still logged once
                await replicas_of(p).probed.wait()
                replicas_of(p).probed.clear()
                rounds += 1
            for i in range(6):
                resp = await call(p, f"r{i}")
                assert resp.headers["X-Capture-Status"] == "staged"
                assert p.calls(f"r{i}")[0].replica in {a, b}
            assert fleet.served_by(old) == fleet.served_by(late) == 0
            ready = await (await p.client.get("/readyz")).json()
            by_name = {r["replica"]: r for r in ready["replicas"]}
            assert by_name[old]["state"] == by_name[late]["state"] == "quarantined"
            assert (
                "vLLM version 0.31.0 where the fleet's (the other replicas') is 0.32.0"
                in by_name[old]["problem"]
            )
            assert "tokenizer fingerprint" in by_name[late]["problem"]
            assert "vLLM" not in by_name[late]["problem"]
            assert ready["ready"] is True  # two healthy replicas serve
        finally:
            await stop_proxy(p)
    quarantined = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(quarantined) == 2
    assert any(old in m for m in quarantined)
    assert any(late in m for m in quarantined)


async def test_no_healthy_replica_refuses_new_rollouts_and_fails_readiness(
    tmp_path: Path, fleet: Fleet
) -> None:
    a = fleet.reserve(FakeVLLM())
    b = fleet.reserve(FakeVLLM())  # neither started
    p = await start_fleet_proxy(tmp_path, fleet)
    try:
        resp = await call(p, "r1")
        assert resp.status == 503
        error = (await resp.json())["error"]
        assert error["code"] == "upstream_unavailable"
        assert error["message"].startswith(f"no healthy upstream replica: {a} unreachable")
        ready = await p.client.get("/readyz")
        assert ready.status == 503
        assert (await ready.json())["problems"][0].startswith("no healthy upstream replica")
        resp = await p.client.get("/v1/models")  # pass-through routes too
        assert resp.status == 503
        await fleet.start(b)
        await until(lambda: replicas_of(p).by_name[b].state == "healthy")
        assert (await call(p, "r1")).headers["X-Capture-Status"] == "staged"
        assert (await p.client.get("/v1/models")).status == 200
    finally:
        await stop_proxy(p)


async def test_metrics_carry_a_replica_label(tmp_path: Path, fleet: Fleet) -> None:
    a, b = await fleet.add(), await fleet.add()
    p = await start_fleet_proxy(tmp_path, fleet)
    try:
        for i in range(4):
            await call(p, f"r{i}")
        pinned = p.calls("r0")[0].replica
        await fleet.stop(pinned)
        await call(p, "r0", "gone")
        text = await (await p.client.get("/metrics")).text()
        for url in (a, b):
            assert f'capture_proxy_replica_calls_total{{outcome="staged",replica="{url}"}} 2.0' in (
                text
            )
            assert re.search(
                rf'capture_proxy_replica_upstream_duration_seconds_count{{replica="{url}"}} 2\.0',
                text,
            )
        assert (
            "capture_proxy_replica_upstream_errors_total"
            f'{{reason="upstream_unreachable",replica="{pinned}"}} 1.0'
        ) in text
        assert (
            f'capture_proxy_replica_healthy{{replica="{pinned}",state="unreachable"}} 0.0' in text
        )
    finally:
        await stop_proxy(p)


async def test_a_single_upstream_has_no_replica_series(make_proxy: Any) -> None:
    p = await make_proxy()
    assert (await call(p, "r1")).headers["X-Capture-Status"] == "staged"
    assert p.calls("r1")[0].replica == ""
    text = await (await p.client.get("/metrics")).text()
    assert 'replica="' not in text
    ready = await (await p.client.get("/readyz")).json()
    assert "replicas" not in ready


async def test_weight_routes_reach_every_healthy_replica_and_report_a_failed_push(
    tmp_path: Path, fleet: Fleet
) -> None:
    a = await fleet.add(FakeVLLM(dev_mode=True))
    b = await fleet.add(FailingPush(dev_mode=True))
    p = await start_fleet_proxy(tmp_path, fleet, admin_token=TOKEN)
    try:
        resp = await p.client.post("/admin/weights/pause", headers=ADMIN)
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert body["engine"] == "paused"
        assert body["engine_replicas"] == {a: "paused", b: "paused"}
        assert not fleet.fakes[a].running.is_set()
        assert not fleet.fakes[b].running.is_set()
        resp = await p.client.put(
            "/admin/weight-version", json={"weight_version": 7}, headers=ADMIN
        )
        assert resp.status == 200
        body = await resp.json()
        assert body["weight_version"] == 7
        assert body["engine"] == "failed"
        assert body["engine_error"].startswith(f"{b}: failed: upstream /update_weight_version")
        assert body["engine_replicas"][a] == "updated"
        assert fleet.fakes[a].weight_version == "7"
        resp = await p.client.post("/admin/weights/resume", headers=ADMIN)
        assert resp.status == 200
        body = await resp.json()
        assert body["engine_resume"] == "resumed"
        assert body["engine_resume_replicas"] == {a: "resumed", b: "resumed"}
        assert fleet.fakes[a].running.is_set()
        assert fleet.fakes[b].running.is_set()
        # A replica that is down is skipped, and said to be.
        await fleet.stop(b)
        await until(lambda: replicas_of(p).by_name[b].state == "unreachable")
        resp = await p.client.put(
            "/admin/weight-version", json={"weight_version": 8}, headers=ADMIN
        )
        body = await resp.json()
        assert body["engine"] == "updated"
        assert body["engine_replicas"] == {a: "updated", b: "skipped: unreachable"}
        # None healthy: the version is stored, and the push reached no engine.
        await fleet.stop(a)
        await until(lambda: replicas_of(p).by_name[a].state == "unreachable")
        resp = await p.client.put(
            "/admin/weight-version", json={"weight_version": 9}, headers=ADMIN
        )
        assert resp.status == 200
        body = await resp.json()
        assert (body["weight_version"], body["engine"]) == (9, "failed")
        assert body["engine_error"].startswith("no healthy replica to reach: ")
    finally:
        await stop_proxy(p)


async def test_a_sealed_rollout_is_refused_without_a_new_pin(tmp_path: Path, fleet: Fleet) -> None:
    await fleet.add()
    await fleet.add()
    p = await start_fleet_proxy(tmp_path, fleet, admin_token=TOKEN)
    assert (await call(p, "r1")).headers["X-Capture-Status"] == "staged"
    assert (await p.client.post("/admin/rollouts/r1/seal", headers=ADMIN)).status == 200
    await stop_proxy(p)
    p = await start_fleet_proxy(tmp_path, fleet, admin_token=TOKEN)  # the seal is in the store
    try:
        for _ in range(2):  # the second finds it remembered as sealed, without its pin
            resp = await call(p, "r1", "after the seal")
            assert resp.status == 409
        await p.state.pipeline.wait_background(5.0)
        assert len(_events(p.store_url, "r1")) == 1  # no pin written into a sealed rollout
    finally:
        await stop_proxy(p)


async def test_a_pause_that_fails_on_one_replica_is_a_502_naming_it(
    tmp_path: Path, fleet: Fleet
) -> None:
    a = await fleet.add(FakeVLLM(dev_mode=True))
    b = await fleet.add(FailingPause(dev_mode=True))
    p = await start_fleet_proxy(tmp_path, fleet, admin_token=TOKEN, pause_hold_seconds=0.1)
    try:
        resp = await p.client.post("/admin/weights/pause", headers=ADMIN)
        assert resp.status == 502
        error = (await resp.json())["error"]
        assert error["code"] == "upstream_weights_route"
        assert error["message"].startswith(f"pausing the replicas failed: {b}: failed: upstream")
        assert not fleet.fakes[a].running.is_set()  # the other one was paused
        refused = await call(p, "r1")  # the proxy stays paused: a retry is safe
        assert (await refused.json())["error"]["code"] == "paused"
    finally:
        await stop_proxy(p)
