"""A weight update through the control API: `POST /admin/weights/pause` stops admitting calls
(a new one is held, then 503 ``paused`` with Retry-After and ``rejected`` in its ledger), waits
for the calls in flight (cutting the ones past its deadline) and pauses vLLM in dev mode;
`POST /admin/weights/resume` sets the weight version (pushed to vLLM), resumes vLLM, admits again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp.test_utils import TestClient, TestServer

from capture_proxy.schemas.records import CallStatus
from capture_proxy.server.app import create_admin_app
from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import chat_body, user

TOKEN = "admin-token-for-weights-0123"
READER = "reader-token-for-weights-4567"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


async def test_a_paused_proxy_holds_a_new_call_then_answers_503_paused(make_proxy: Any) -> None:
    fake = FakeVLLM(dev_mode=True)
    p = await make_proxy(fake=fake, admin_token=TOKEN, pause_hold_seconds=0.3)
    resp = await p.client.post("/admin/weights/pause", headers=ADMIN)
    assert resp.status == 200, await resp.text()
    assert await resp.json() == {
        "paused": True,
        "already_paused": False,
        "cut": [],
        "engine": "paused",
    }
    assert fake.route_hits["/pause"] == 1
    started = asyncio.get_running_loop().time()
    refused = await p.chat(chat_body(user("during the pause")))
    assert asyncio.get_running_loop().time() - started >= 0.3  # held first
    assert refused.status == 503
    assert refused.headers["Retry-After"]
    assert (await refused.json())["error"]["code"] == "paused"
    (entry,) = p.failures()
    assert (entry.status, entry.reason, entry.http_status) == (CallStatus.REJECTED, "paused", 503)
    assert fake.requests == []  # nothing reached vLLM


async def test_a_held_call_goes_on_when_the_pause_ends(make_proxy: Any) -> None:
    fake = FakeVLLM(dev_mode=True)
    p = await make_proxy(fake=fake, admin_token=TOKEN, pause_hold_seconds=10)
    await p.client.post("/admin/weights/pause", headers=ADMIN)
    held = asyncio.ensure_future(p.chat(chat_body(user("held"))))
    await asyncio.sleep(0.2)
    assert not held.done()
    resp = await p.client.post("/admin/weights/resume", json={"weight_version": 7}, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    assert await resp.json() == {
        "paused": False,
        "weight_version": 7,
        "engine": "updated",
        "engine_resume": "resumed",
    }
    assert (await held).status == 200
    (record,) = p.calls()
    assert record.weight_version == 7
    assert fake.weight_version == "7"  # pushed to vLLM's /update_weight_version
    assert fake.route_hits["/resume"] == 1


async def test_pause_answers_once_the_calls_in_flight_have_finished(
    make_proxy: Any,
) -> None:
    fake = FakeVLLM(dev_mode=True, latency=0.3)
    p = await make_proxy(fake=fake, admin_token=TOKEN, pause_drain_timeout=2.0)
    inflight = asyncio.ensure_future(p.chat(chat_body(user("slow"))))
    await asyncio.sleep(0.1)
    resp = await p.client.post("/admin/weights/pause", headers=ADMIN)
    assert inflight.done()  # the pause answered only once the call had finished
    assert (await inflight).status == 200
    assert (await resp.json())["cut"] == []


async def test_a_call_past_the_pause_deadline_is_cut_and_listed(make_proxy: Any) -> None:
    fake = FakeVLLM(dev_mode=True, latency=5.0)
    p = await make_proxy(fake=fake, admin_token=TOKEN, pause_drain_timeout=0.3)
    slow = asyncio.ensure_future(p.chat(chat_body(user("too slow")), rollout="r2"))
    await asyncio.sleep(0.1)
    resp = await p.client.post("/admin/weights/pause", headers=ADMIN)
    (cut,) = (await resp.json())["cut"]
    assert (cut["rollout_id"], cut["seq"]) == ("r2", 0)
    # The client gets a 503 it retries after the pause, not a dropped connection.
    answer = await slow
    assert answer.status == 503
    assert answer.headers["Retry-After"] == "5"
    assert answer.headers["X-Capture-Status"] == "aborted"
    assert answer.headers["X-Capture-Call-Id"] == cut["call_id"]
    error = (await answer.json())["error"]
    assert error["code"] == "weights_paused"
    assert "retry it once the proxy resumes" in error["message"]
    (entry,) = p.failures("r2")  # recorded before the client was answered
    assert (entry.call_id, entry.status, entry.reason) == (
        cut["call_id"],
        CallStatus.ABORTED,
        "weights_paused",
    )


async def test_a_stream_past_the_pause_deadline_ends_with_a_weights_paused_error_event(
    make_proxy: Any,
) -> None:
    fake = FakeVLLM(dev_mode=True, chunk_delay=1.0)
    p = await make_proxy(fake=fake, admin_token=TOKEN, pause_drain_timeout=0.3)
    resp = await p.chat(chat_body(user("a slow stream"), stream=True), rollout="r3")
    assert resp.status == 200
    pause = asyncio.ensure_future(p.client.post("/admin/weights/pause", headers=ADMIN))
    body = (await resp.read()).decode()
    (cut,) = (await (await pause).json())["cut"]
    events = [line for line in body.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in body  # never a complete-looking stream
    error = orjson.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "weights_paused"
    (entry,) = p.failures("r3")
    assert (entry.call_id, entry.reason) == (cut["call_id"], "weights_paused")


async def test_both_are_idempotent_and_work_without_dev_mode(make_proxy: Any) -> None:
    fake = FakeVLLM()  # no VLLM_SERVER_DEV_MODE: /pause and friends answer 404
    p = await make_proxy(fake=fake, admin_token=TOKEN)
    first = await (await p.client.post("/admin/weights/pause", headers=ADMIN)).json()
    second = await (await p.client.post("/admin/weights/pause", headers=ADMIN)).json()
    assert (first["already_paused"], second["already_paused"]) == (False, True)
    assert first["engine"] == second["engine"] == "not_served"
    assert fake.route_hits["/pause"] == 2  # asked, 404 tolerated
    for _ in range(2):
        resp = await p.client.post(
            "/admin/weights/resume", json={"weight_version": 3}, headers=ADMIN
        )
        assert await resp.json() == {
            "paused": False,
            "weight_version": 3,
            "engine": "not_served",
            "engine_resume": "not_served",
        }
    assert (await p.chat(chat_body(user("after")))).status == 200
    assert p.calls()[0].weight_version == 3


async def test_a_failing_engine_pause_is_a_502_and_the_proxy_stays_paused(
    make_proxy: Any,
) -> None:
    p = await make_proxy(admin_token=TOKEN, pause_hold_seconds=0.1)
    await p.upstream.close()  # vLLM gone
    resp = await p.client.post("/admin/weights/pause", headers=ADMIN)
    assert resp.status == 502
    assert p.state.capture.paused
    assert (await p.chat(chat_body(user("x")))).status == 503


async def test_only_the_admin_token_pauses_and_resumes(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN, reader_token=READER)
    for path in ("/admin/weights/pause", "/admin/weights/resume"):
        reader = await p.client.post(path, headers={"Authorization": f"Bearer {READER}"})
        assert reader.status == 403, path
        assert (await p.client.post(path)).status == 401, path
    assert not p.state.capture.paused


async def test_pause_and_resume_live_on_the_admin_listener_only(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN, admin_port=1)
    for path in ("/admin/weights/pause", "/admin/weights/resume"):
        assert (await p.client.post(path, headers=ADMIN)).status == 404, path
    admin = TestClient(TestServer(create_admin_app(p.client.app)))
    await admin.start_server()
    try:
        assert (await admin.post("/admin/weights/pause", headers=ADMIN)).status == 200
        assert (await admin.post("/admin/weights/resume", headers=ADMIN)).status == 200
    finally:
        await admin.close()
