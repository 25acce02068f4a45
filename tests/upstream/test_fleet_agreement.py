"""Replicas agree or are kept out (docs/fleets.md): model name, vLLM version, tokenizer
fingerprint and engine weight version must be the fleet's, which is configured or a majority,
judged again as replicas come and go; a replica that missed a weight update takes calls only
once its own engine reports the fleet's weights. Each replica is a real fake vLLM on loopback."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from capture_proxy.schemas.records import CallStatus
from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import Proxy, stop_proxy
from tests.support.replicas import Fleet, call, replicas_of, start_fleet_proxy, until

TOKEN = "admin-token-for-fleet-agreement-0123"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


class NoTokenize(FakeVLLM):
    """A server that answers like vLLM except that ``/tokenize`` is not one of its routes."""

    async def _tokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)


def _state(p: Proxy, url: str) -> str:
    return replicas_of(p).by_name[url].state


async def test_a_replica_serving_another_model_name_is_wrong_model_and_takes_no_calls(
    tmp_path: Path, fleet: Fleet
) -> None:
    a, b = await fleet.add(), await fleet.add()
    other = await fleet.add(FakeVLLM(model="other-policy"))  # same tokenizer and version
    p = await start_fleet_proxy(tmp_path, fleet)
    try:
        assert _state(p, other) == "wrong_model"
        problem = replicas_of(p).by_name[other].problem
        assert (
            problem == "model name other-policy where the fleet's (the other replicas') is policy"
        )
        for i in range(6):
            resp = await call(p, f"r{i}")
            assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
            assert p.calls(f"r{i}")[0].replica in {a, b}
        assert fleet.served_by(other) == 0
    finally:
        await stop_proxy(p)


async def test_the_configured_model_name_decides_where_two_replicas_disagree(
    tmp_path: Path, fleet: Fleet
) -> None:
    other = await fleet.add(FakeVLLM(model="other-policy"))
    good = await fleet.add()
    p = await start_fleet_proxy(tmp_path, fleet, served_model="policy")
    try:
        assert (_state(p, good), _state(p, other)) == ("healthy", "wrong_model")
        assert "the fleet's (configured) is policy" in replicas_of(p).by_name[other].problem
        assert (await call(p, "r1")).headers["X-Capture-Status"] == "staged"
        assert p.calls("r1")[0].replica == good
    finally:
        await stop_proxy(p)


async def test_the_majority_is_judged_again_as_replicas_come(tmp_path: Path, fleet: Fleet) -> None:
    odd = await fleet.add(FakeVLLM(version="0.31.0"))
    a, b = fleet.reserve(FakeVLLM()), fleet.reserve(FakeVLLM())  # start after the proxy
    p = await start_fleet_proxy(tmp_path, fleet)
    try:
        # Alone, the odd one is the fleet: it serves.
        assert _state(p, odd) == "healthy"
        assert (await call(p, "early")).headers["X-Capture-Status"] == "staged"
        await fleet.start(a)
        await fleet.start(b)
        # Two of three now agree: the fleet re-forms around them.
        await until(lambda: _state(p, a) == _state(p, b) == "healthy")
        assert _state(p, odd) == "quarantined"
        assert "vLLM version 0.31.0 where the fleet's" in replicas_of(p).by_name[odd].problem
        ready = await (await p.client.get("/readyz")).json()
        assert ready["fleet"]["version"] == "0.32.0"
        assert ready["fleet"]["agreed"] is True
        for i in range(4):
            assert (await call(p, f"r{i}")).headers["X-Capture-Status"] == "staged"
            assert p.calls(f"r{i}")[0].replica in {a, b}
        # The rollout placed on the odd one waits for it (503 naming it), and the metrics
        # count the refusal under its replica.
        resp = await call(p, "early", "again")
        assert resp.status == 503
        message = (await resp.json())["error"]["message"]
        assert f"pinned to replica {odd}, which is quarantined" in message
        assert [(f.status, f.reason) for f in p.failures("early")] == [
            (CallStatus.REJECTED, "upstream_unavailable")
        ]
        text = await (await p.client.get("/metrics")).text()
        assert f'capture_proxy_replica_calls_total{{outcome="rejected",replica="{odd}"}} 1.0' in (
            text
        )
    finally:
        await stop_proxy(p)


async def test_without_a_majority_every_replica_is_held_and_readyz_and_metrics_say_so(
    tmp_path: Path, fleet: Fleet
) -> None:
    a = await fleet.add()
    b = await fleet.add(FakeVLLM(version="0.31.0"))
    p = await start_fleet_proxy(tmp_path, fleet)
    try:
        assert _state(p, a) == _state(p, b) == "held"
        resp = await call(p, "r1")
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "upstream_unavailable"
        assert fleet.served_by(a) == fleet.served_by(b) == 0
        ready = await p.client.get("/readyz")
        assert ready.status == 503
        body = await ready.json()
        assert body["fleet"]["agreed"] is False
        assert body["fleet"]["problem"].startswith(
            f"no majority of the replicas agrees on the vLLM version ({a}: 0.32.0; {b}: 0.31.0)"
        )
        assert "held (no majority" in body["problems"][0]
        text = await (await p.client.get("/metrics")).text()
        for url in (a, b):
            assert f'capture_proxy_replica_healthy{{replica="{url}",state="held"}} 0.0' in text
    finally:
        await stop_proxy(p)


async def test_a_replica_answering_tokenize_404_is_missing_route_not_down(
    tmp_path: Path, fleet: Fleet
) -> None:
    a, b = await fleet.add(), await fleet.add()
    bare = await fleet.add(NoTokenize())
    p = await start_fleet_proxy(tmp_path, fleet)
    try:
        assert (_state(p, a), _state(p, b), _state(p, bare)) == (
            "healthy",
            "healthy",
            "missing_route",
        )
        assert replicas_of(p).by_name[bare].problem.startswith("/tokenize answered 404")
    finally:
        await stop_proxy(p)


async def test_a_replica_that_missed_a_weight_update_takes_calls_only_once_its_engine_has_them(
    tmp_path: Path, fleet: Fleet
) -> None:
    a = await fleet.add(FakeVLLM(dev_mode=True))
    b = await fleet.add(FakeVLLM(dev_mode=True))
    late = await fleet.add(FakeVLLM(dev_mode=True))
    p = await start_fleet_proxy(tmp_path, fleet, admin_token=TOKEN)
    try:
        await fleet.stop(late)
        await until(lambda: _state(p, late) == "unreachable")
        assert (await p.client.post("/admin/weights/pause", headers=ADMIN)).status == 200
        resp = await p.client.post(
            "/admin/weights/resume", json={"weight_version": 9}, headers=ADMIN
        )
        body = await resp.json()
        assert body["engine_replicas"] == {a: "updated", b: "updated", late: "skipped: unreachable"}
        # It restarts on its old weights ("default"): kept out, and never relabelled.
        fleet.fakes[late] = FakeVLLM(dev_mode=True)
        await fleet.start(late)
        await until(lambda: _state(p, late) == "stale_weights")
        problem = replicas_of(p).by_name[late].problem
        assert problem == "engine weight version default where the fleet's (configured) is 9"
        for i in range(6):
            resp = await call(p, f"r{i}")
            assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
            record = p.calls(f"r{i}")[0]
            assert record.replica in {a, b}
            assert (record.weight_version, record.engine_weight_version) == (9, "9")
        assert fleet.served_by(late) == 0
        assert fleet.fakes[late].route_hits["/update_weight_version"] == 0
        assert fleet.fakes[late].weight_version == "default"
        ready = await (await p.client.get("/readyz")).json()
        assert ready["fleet"]["engine_weight_version"] == "9"
        # The trainer loads the weights into it and labels them: it takes calls again.
        fleet.fakes[late].weight_version = "9"
        await until(lambda: _state(p, late) == "healthy")
        for i in range(6, 12):
            assert (await call(p, f"r{i}")).headers["X-Capture-Status"] == "staged"
        assert fleet.served_by(late) > 0
    finally:
        await stop_proxy(p)


async def test_a_call_to_an_engine_that_changed_weights_since_its_probe_is_refused(
    tmp_path: Path, fleet: Fleet
) -> None:
    a = await fleet.add(FakeVLLM(dev_mode=True))
    b = await fleet.add(FakeVLLM(dev_mode=True))
    p = await start_fleet_proxy(tmp_path, fleet, admin_token=TOKEN, replica_probe_interval=60)
    try:
        resp = await p.client.put(
            "/admin/weight-version", json={"weight_version": 3}, headers=ADMIN
        )
        assert (await resp.json())["engine"] == "updated"
        assert (await call(p, "r1")).headers["X-Capture-Status"] == "staged"
        pinned = p.calls("r1")[0].replica
        served = fleet.served_by(pinned)
        # Its engine restarted on other weights; no probe ran since.
        fleet.fakes[pinned].weight_version = "default"
        resp = await call(p, "r1", "next")
        assert resp.status == 503
        error = (await resp.json())["error"]
        assert error["code"] == "upstream_unavailable"
        assert f"replica {pinned} is stale_weights" in error["message"]
        assert fleet.served_by(pinned) == served  # nothing sampled by the other weights
        assert _state(p, pinned) == "stale_weights"
        assert [(f.status, f.reason) for f in p.failures("r1")] == [
            (CallStatus.REJECTED, "upstream_unavailable")
        ]
        other = b if pinned == a else a
        assert (await call(p, "r2")).headers["X-Capture-Status"] == "staged"
        assert p.calls("r2")[0].replica == other
    finally:
        await stop_proxy(p)


async def test_calls_refused_before_routing_count_under_their_rollouts_replica(
    tmp_path: Path, fleet: Fleet
) -> None:
    """A pinned rollout's call refused before it is routed (held past a weight-update pause,
    a body over the size limit) is counted under the replica the rollout is pinned to."""
    await fleet.add(FakeVLLM())
    await fleet.add(FakeVLLM())
    p = await start_fleet_proxy(
        tmp_path, fleet, admin_token="admin-token", pause_hold_seconds=0.1, max_body_bytes=4096
    )
    try:
        assert (await call(p, "r1")).headers["X-Capture-Status"] == "staged"
        pinned = p.calls("r1")[0].replica
        too_large = await call(p, "r1", "x" * 8192)
        assert too_large.status == 413
        admin = {"Authorization": "Bearer admin-token"}
        assert (await p.client.post("/admin/weights/pause", headers=admin)).status == 200
        paused = await call(p, "r1", "while paused")
        assert (paused.status, (await paused.json())["error"]["code"]) == (503, "paused")
        assert [f.reason for f in p.failures("r1")] == ["body_too_large", "paused"]
        text = await (await p.client.get("/metrics")).text()
        counted = f'capture_proxy_replica_calls_total{{outcome="rejected",replica="{pinned}"}} 2.0'
        assert counted in text
    finally:
        await stop_proxy(p)
