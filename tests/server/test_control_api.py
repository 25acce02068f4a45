"""The control API as a rollout driver uses it: create, call, manifest, seal, fetch coordinates."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from capture_proxy.read.reader import open_store
from capture_proxy.server.app import create_admin_app
from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


async def test_control_api_is_off_without_a_token(make_proxy: Any) -> None:
    p = await make_proxy()
    resp = await p.client.post("/admin/rollouts", json={})
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "control_api_off"


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {TOKEN}", "Bearer "])
async def test_admin_token_required(make_proxy: Any, auth: str | None) -> None:
    p = await make_proxy(admin_token=TOKEN)
    headers = {"Authorization": auth} if auth else {}
    resp = await p.client.post("/admin/rollouts", json={}, headers=headers)
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "admin_token"


async def test_create_rollout_shapes_and_errors(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN, public_url="http://proxy.internal:8100")
    resp = await p.client.post(
        "/admin/rollouts", json={"rollout_id": "ep-1", "metadata": {"task": 7}}, headers=ADMIN
    )
    assert resp.status == 201
    assert await resp.json() == {
        "rollout_id": "ep-1",
        "base_url": "http://proxy.internal:8100/r/ep-1/v1",
        "api_key": None,
        "token_in": None,
    }
    again = await p.client.post("/admin/rollouts", json={"rollout_id": "ep-1"}, headers=ADMIN)
    assert again.status == 409
    generated = await (await p.client.post("/admin/rollouts", json={}, headers=ADMIN)).json()
    assert generated["rollout_id"].startswith("ro-")
    bad = await p.client.post("/admin/rollouts", json={"rollout_id": "a/b"}, headers=ADMIN)
    assert bad.status == 422
    extra = await p.client.post("/admin/rollouts", json={"rolout_id": "x"}, headers=ADMIN)
    assert extra.status == 422
    assert (await extra.json())["error"]["param"] == "rolout_id"


async def test_rollout_keys_keep_sandboxes_apart(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN, require_rollout_keys=True)
    a = await (
        await p.client.post("/admin/rollouts", json={"rollout_id": "A"}, headers=ADMIN)
    ).json()
    b = await (
        await p.client.post("/admin/rollouts", json={"rollout_id": "B"}, headers=ADMIN)
    ).json()
    assert a["api_key"]
    assert b["api_key"]
    assert a["api_key"] != b["api_key"]
    body = chat_body(user("x"))

    def key(k: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {k}"}

    assert (await p.chat(body, rollout="A", headers=key(a["api_key"]))).status == 200
    wrong = await p.chat(body, rollout="B", headers=key(a["api_key"]))
    assert wrong.status == 403
    assert (await wrong.json())["error"]["code"] == "wrong_rollout_key"
    assert (await p.chat(body, rollout="B")).status == 401
    unknown = await p.chat(body, rollout="C", headers=key(a["api_key"]))
    assert unknown.status == 403
    assert (await unknown.json())["error"]["code"] == "unknown_rollout"
    assert len(p.fake.requests) == 1  # nothing but the authorized call was forwarded


async def test_manifest_lists_every_call_with_coords_or_failure(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await p.client.post("/admin/rollouts", json={"rollout_id": "ep"}, headers=ADMIN)
    await p.chat(chat_body(user("first")), rollout="ep")
    await p.chat(chat_body({"role": "user", "content": "x", "thinking_trace": "?"}), rollout="ep")
    await p.chat(chat_body(user("too long"), max_tokens=9000), rollout="ep")
    m = await (await p.client.get("/admin/rollouts/ep/manifest", headers=ADMIN)).json()
    assert m["rollout_id"] == "ep"
    assert m["state"] == "open"
    assert m["poisoned"] is False
    assert [c["seq"] for c in m["calls"]] == [0, 1, 2]
    staged, rejected, upstream = m["calls"]
    assert staged["status"] == "staged"
    assert set(staged["coords"]) == {
        "store",
        "staging_key",
        "digest",
        "extras_digest",
        "prev_len",
        "delta_len",
        "cum_len",
        "weight_version",
    }
    assert rejected["status"] == "rejected"
    assert rejected["http_status"] == 422
    assert "thinking_trace" in rejected["message"]
    assert upstream["status"] == "upstream_error"
    assert upstream["http_status"] == 400
    # A driver fetches the staged coordinates through the reader API, digests verified.
    with open_store(p.store_url) as store:
        (record,) = store.fetch([staged["coords"]])
    assert record.call_id == staged["call_id"]


async def test_seal_waits_for_inflight_then_refuses_calls(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN, fake=FakeVLLM(latency=0.4))
    slow = asyncio.ensure_future(p.chat(chat_body(user("slow")), rollout="ep"))
    for _ in range(100):
        if p.state.capture.inflight:
            break
        await asyncio.sleep(0.01)
    sealed = await (await p.client.post("/admin/rollouts/ep/seal", headers=ADMIN)).json()
    assert (await slow).headers["X-Capture-Status"] == "staged"
    assert sealed["state"] == "sealed"
    assert sealed["in_flight"] == 0
    assert [c["status"] for c in sealed["calls"]] == ["staged"]
    late = await p.chat(chat_body(user("late")), rollout="ep")
    assert late.status == 409
    assert (await late.json())["error"]["code"] == "rollout_sealed"
    assert len(p.fake.requests) == 1
    with open_store(p.store_url) as store:
        assert store.rollout_info("ep").state == "sealed"


async def test_seal_unknown_rollout_is_404(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    assert (await p.client.post("/admin/rollouts/nope/seal", headers=ADMIN)).status == 404
    assert (await p.client.get("/admin/rollouts/nope/manifest", headers=ADMIN)).status == 404


async def test_weight_version_is_stamped_on_later_calls(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await p.chat(chat_body(user("a")))
    resp = await p.client.put("/admin/weight-version", json={"weight_version": 3}, headers=ADMIN)
    assert (await resp.json())["weight_version"] == 3
    await p.chat(chat_body(user("b")))
    assert [r.weight_version for r in p.calls()] == [0, 3]
    bad = await p.client.put("/admin/weight-version", json={"weight_version": -1}, headers=ADMIN)
    assert bad.status == 422


async def test_manifest_survives_a_restart(tmp_path: Any) -> None:
    first = await start_proxy(tmp_path, admin_token=TOKEN)
    await first.chat(chat_body(user("a")), rollout="ep")
    await first.chat(chat_body({"role": "user", "content": "x", "bad": 1}), rollout="ep")
    await stop_proxy(first)
    second = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        m = await (await second.client.get("/admin/rollouts/ep/manifest", headers=ADMIN)).json()
        assert [c["status"] for c in m["calls"]] == ["staged", "rejected"]
        assert m["calls"][0]["coords"]["staging_key"] == m["calls"][0]["call_id"]
        # The rollout resumes where it was: sequence numbers and lineage continue.
        staged = await second.chat(chat_body(user("a")), rollout="ep")
        assert staged.headers["X-Capture-Status"] == "staged"
        first_call, retry = second.calls("ep")
        assert retry.seq == 2
        assert retry.retry_of == first_call.call_id
    finally:
        await stop_proxy(second)


async def test_control_api_on_its_own_port(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN, admin_port=1)  # any non-zero: main app has no /admin
    assert (await p.client.post("/admin/rollouts", json={}, headers=ADMIN)).status == 404
    admin = TestClient(TestServer(create_admin_app(p.client.app)))
    await admin.start_server()
    try:
        resp = await admin.post("/admin/rollouts", json={"rollout_id": "x"}, headers=ADMIN)
        assert resp.status == 201
    finally:
        await admin.close()


async def test_idle_rollouts_leave_memory_and_resume_from_the_store(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await p.chat(chat_body(user("first")), rollout="idle")
    assert "idle" in p.state.capture.rollouts
    assert p.state.capture.evict_idle(0.0) == ["idle"]  # nothing in flight, idle for >= 0 s
    assert "idle" not in p.state.capture.rollouts
    resp = await p.chat(chat_body(user("first")), rollout="idle")  # the same request again
    assert resp.headers["X-Capture-Status"] == "staged"
    first, again = p.calls("idle")
    assert again.seq == 1
    assert again.retry_of == first.call_id


async def test_sealing_drops_the_rollouts_prompt_prefix_cache(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    await p.chat(chat_body(user("x")), rollout="ep")
    adapters = list(p.state.pipeline._adapters.values())
    assert any(a.prefixes.get("ep") is not None for a in adapters)
    assert (await p.client.post("/admin/rollouts/ep/seal", headers=ADMIN)).status == 200
    assert all(a.prefixes.get("ep") is None for a in adapters)
