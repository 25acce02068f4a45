"""Sandboxes reach their own rollout and nothing else (issue: reliability, 5).

What test_control_api.py and test_proxy_routes.py already hold (admin token, per-rollout keys on
the chat route, the upstream key never leaking, the client's Authorization never forwarded) is not
repeated here. This module adds: keys on the pass-through routes under ``/r/{id}``, admin routes
out of reach of a rollout key, the rollout a key belongs to cannot be swapped through headers,
requests cannot steer the proxy to other hosts or to other upstream paths, rollout keys never
show up where they should not, and keys across a restart.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from capture_proxy.server.app import create_admin_app
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user

TOKEN = "admin-secret-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def keyed(make_proxy: Any, **settings: Any) -> tuple[Proxy, str, str]:
    """A proxy requiring rollout keys, with rollouts A and B created; their keys."""
    p: Proxy = await make_proxy(admin_token=TOKEN, require_rollout_keys=True, **settings)
    keys = []
    for rollout in ("A", "B"):
        resp = await p.client.post("/admin/rollouts", json={"rollout_id": rollout}, headers=ADMIN)
        assert resp.status == 201
        keys.append((await resp.json())["api_key"])
    return p, keys[0], keys[1]


async def raw_get(p: Proxy, target: str, headers: bytes = b"") -> tuple[int, bytes]:
    """A GET with the request target sent byte for byte (clients normalize paths)."""
    port = p.client.port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
            + headers
            + b"\r\n"
        )
        await writer.drain()
        async with asyncio.timeout(10):
            raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


# -- admin routes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/admin/rollouts", {"rollout_id": "C"}),
        ("GET", "/admin/rollouts/A/manifest", None),  # even its own rollout's manifest
        ("GET", "/admin/rollouts/B/manifest", None),
        ("POST", "/admin/rollouts/A/seal", None),
        ("PUT", "/admin/weight-version", {"weight_version": 9}),
    ],
)
async def test_a_rollout_key_opens_no_admin_route(
    make_proxy: Any, method: str, path: str, body: Any
) -> None:
    p, key_a, _ = await keyed(make_proxy)
    resp = await p.client.request(method, path, json=body, headers=bearer(key_a))
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "admin_token"
    manifest = await (await p.client.get("/admin/rollouts/A/manifest", headers=ADMIN)).json()
    assert manifest["state"] == "open"  # the seal did not happen
    assert p.state.capture.weight_version == 0
    assert "C" not in p.state.capture.rollouts


async def test_admin_routes_are_not_under_the_rollout_prefix(make_proxy: Any) -> None:
    p, key_a, _ = await keyed(make_proxy)
    for headers in (ADMIN, bearer(key_a)):
        resp = await p.client.post("/r/A/admin/rollouts", json={}, headers=headers)
        assert resp.status == 404


async def test_the_admin_token_is_not_a_rollout_key(make_proxy: Any) -> None:
    p, _, _ = await keyed(make_proxy)
    resp = await p.chat(chat_body(user("x")), rollout="A", headers=ADMIN)
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "wrong_rollout_key"
    assert p.fake.requests == []


async def test_admin_port_keeps_the_control_api_off_the_sandbox_port(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN, admin_port=1)
    for path in ("/admin/rollouts", "/r/x/admin/rollouts"):
        resp = await p.client.post(path, json={}, headers=ADMIN)
        assert resp.status == 404, path


# -- the rollout a key belongs to -----------------------------------------------------------


@pytest.mark.parametrize("header", ["X-Rollout-Id", "x-session-id"])
async def test_a_key_cannot_be_pointed_at_another_rollout_by_header(
    make_proxy: Any, header: str
) -> None:
    p, key_a, _ = await keyed(make_proxy)
    resp = await p.chat(chat_body(user("x")), rollout=None, headers={**bearer(key_a), header: "B"})
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "wrong_rollout_key"
    assert p.fake.requests == []


async def test_the_path_decides_the_rollout_over_headers(make_proxy: Any) -> None:
    p, key_a, _ = await keyed(make_proxy)
    resp = await p.chat(
        chat_body(user("x")), rollout="A", headers={**bearer(key_a), "X-Rollout-Id": "B"}
    )
    assert resp.headers["X-Capture-Status"] == "staged"
    assert [r.call_id for r in p.calls("A")] == [resp.headers["X-Capture-Call-Id"]]
    assert p.calls("B") == []


@pytest.mark.parametrize(
    ("rollout", "header"),
    [("driver-42", None), (None, "X-Rollout-Id"), (None, "x-session-id")],
)
async def test_a_sandbox_cannot_squat_a_rollout_id_before_its_driver_creates_it(
    make_proxy: Any, rollout: str | None, header: str | None
) -> None:
    # The settings every file in deploy/ ships (docs/security.md).
    p, key_a, _ = await keyed(make_proxy, require_rollout_id=True)
    headers = {**bearer(key_a), **({header: "driver-42"} if header else {})}
    resp = await p.chat(chat_body(user("squat")), rollout=rollout, headers=headers)
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "unknown_rollout"
    assert p.fake.requests == []
    source = p.source()
    try:
        assert "driver-42" not in source.rollouts()  # the refusal created nothing
    finally:
        source.close_reader()
    # The driver creates the id later: it is still free, and only its own key writes into it.
    resp = await p.client.post("/admin/rollouts", json={"rollout_id": "driver-42"}, headers=ADMIN)
    assert resp.status == 201
    key = (await resp.json())["api_key"]
    resp = await p.chat(chat_body(user("hi")), rollout="driver-42", headers=bearer(key))
    assert resp.headers["X-Capture-Status"] == "staged"
    assert [r.call_id for r in p.calls("driver-42")] == [resp.headers["X-Capture-Call-Id"]]
    assert p.failures("driver-42") == []
    # A call that names no rollout at all is refused as such.
    resp = await p.chat(chat_body(user("x")), rollout=None, headers=bearer(key))
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "rollout_id_required"


PASSTHROUGH = [
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("POST", "/tokenize", {"model": "policy", "prompt": "hi"}),
    ("POST", "/detokenize", {"model": "policy", "tokens": [104, 105]}),
]


@pytest.mark.parametrize(("method", "route", "body"), PASSTHROUGH)
async def test_rollout_keys_guard_pass_through_routes_under_the_prefix(
    make_proxy: Any, method: str, route: str, body: Any
) -> None:
    p, key_a, key_b = await keyed(make_proxy)
    own = await p.client.request(method, f"/r/A{route}", json=body, headers=bearer(key_a))
    assert own.status == 200
    missing = await p.client.request(method, f"/r/A{route}", json=body)
    assert missing.status == 401
    other = await p.client.request(method, f"/r/A{route}", json=body, headers=bearer(key_b))
    assert other.status == 403


# -- no other host, no other upstream path ------------------------------------------------------


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[str, list[tuple[str, str]]]]:
    """An upstream that answers every path and records (method, raw path) of each request."""
    seen: list[tuple[str, str]] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append((request.method, request.raw_path))
        if request.path == "/tokenize":
            return web.json_response({"count": 2, "max_model_len": 8192, "tokens": [1, 2]})
        return web.json_response({"version": "0.32.0", "object": "list", "data": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    server = TestServer(app)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), seen
    await server.close()


ALLOWED_UPSTREAM = {"/v1/models", "/version", "/tokenize", "/detokenize"}
TRICKS = [
    "/r/a%2F..%2F..%2Fmetrics%3F/version",
    "/r/..%2F..%2Fserver_info%23/version",
    "/r/x%2Fy/v1/models",
    "/r/%2e%2e%2F%2e%2e%2Fsleep%3Flevel=1&x=/version",
]


@pytest.mark.parametrize("target", TRICKS)
async def test_pass_through_reaches_only_its_own_upstream_route(
    make_proxy: Any, recorder: tuple[str, list[tuple[str, str]]], target: str
) -> None:
    url, seen = recorder
    p = await make_proxy(upstream=url)
    status, _ = await raw_get(p, target)
    assert status < 500
    assert all(path in ALLOWED_UPSTREAM for _, path in seen), seen


async def test_absolute_form_and_foreign_host_still_go_to_the_configured_upstream(
    make_proxy: Any, recorder: tuple[str, list[tuple[str, str]]]
) -> None:
    url, seen = recorder
    p = await make_proxy(upstream=url)
    for target, host in [
        ("http://169.254.169.254/latest/meta-data/version", b"169.254.169.254"),
        ("/version", b"evil.example:80"),
    ]:
        status, _ = await raw_get(p, target, b"Host: " + host + b"\r\nX-Forwarded-Host: evil\r\n")
        assert status in (200, 400, 404), target
    # Whatever was forwarded went to the configured upstream (the recorder), on its own route.
    assert all(path in ALLOWED_UPSTREAM for _, path in seen), seen


async def test_remote_image_urls_are_never_fetched(
    make_proxy: Any, recorder: tuple[str, list[tuple[str, str]]]
) -> None:
    url, seen = recorder
    p = await make_proxy()
    image = {"type": "image_url", "image_url": {"url": f"{url}/secret.png"}}
    resp = await p.chat(chat_body({"role": "user", "content": [image]}))
    assert resp.status == 422
    assert (await resp.json())["error"]["code"] == "remote_media_refused"
    assert seen == []  # the proxy did not fetch it
    assert p.fake.requests == []  # nor hand it to the upstream to fetch


# -- keys stay secret, and last ---------------------------------------------------------------


async def test_rollout_keys_never_show_where_they_should_not(
    make_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    p, key_a, key_b = await keyed(make_proxy)
    assert (await p.chat(chat_body(user("x")), rollout="A", headers=bearer(key_a))).status == 200
    assert (await p.chat(chat_body(user("y")), rollout="A", headers=bearer(key_b))).status == 403
    shown = [
        await (await p.client.get("/admin/rollouts/A/manifest", headers=ADMIN)).text(),
        await (await p.client.get("/metrics")).text(),
        await (await p.client.get("/readyz")).text(),
        caplog.text,
        repr(p.fake.request_headers),
        orjson.dumps(p.fake.requests).decode(),
    ]
    with sqlite3.connect(p.store_url.removeprefix("sqlite:///")) as db:
        shown.append("\n".join(db.iterdump()))
    for text in shown:
        assert key_a not in text
        assert key_b not in text
        assert TOKEN not in text


async def test_a_sandbox_keeps_its_key_across_a_proxy_restart(tmp_path: Path) -> None:
    first = await start_proxy(tmp_path, admin_token=TOKEN, require_rollout_keys=True)
    created = await first.client.post("/admin/rollouts", json={"rollout_id": "A"}, headers=ADMIN)
    key = (await created.json())["api_key"]
    assert (await first.chat(chat_body(user("a")), rollout="A", headers=bearer(key))).status == 200
    await stop_proxy(first)
    second = await start_proxy(tmp_path, admin_token=TOKEN, require_rollout_keys=True)
    try:
        again = await second.chat(chat_body(user("b")), rollout="A", headers=bearer(key))
        assert again.status == 200, await again.text()
        wrong = await second.chat(chat_body(user("c")), rollout="A", headers=bearer("x" + key))
        assert wrong.status == 403
    finally:
        await stop_proxy(second)


async def test_the_sandbox_port_shows_readiness_but_no_operator_detail(make_proxy: Any) -> None:
    # Issue 27: /readyz and /metrics on the sandbox port showed the replicas' URLs, versions and
    # models. With the control API on its own port, they move there; sandboxes keep a status.
    p = await make_proxy(admin_token=TOKEN, admin_port=1)
    ready = await p.client.get("/readyz")
    assert ready.status == 200
    assert await ready.json() == {"ready": True}
    for path in ("/metrics", "/metrics/upstream"):
        assert (await p.client.get(path)).status == 404, path
    admin = TestClient(TestServer(create_admin_app(p.client.app)))
    await admin.start_server()
    try:
        detail = await (await admin.get("/readyz")).json()
        assert detail["ready"] is True
        assert "problems" in detail
        assert "capture_proxy_calls_total" in await (await admin.get("/metrics")).text()
        # vLLM's own series, relayed: Prometheus needs no way to vLLM's port (dev mode).
        upstream = await admin.get("/metrics/upstream")
        assert upstream.status == 200
        assert "vllm:num_requests_running" in await upstream.text()
    finally:
        await admin.close()
