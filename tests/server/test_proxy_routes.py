"""Pass-through routes, 404s, health, metrics, and the header rules of docs/contract.md."""

from __future__ import annotations

import logging
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.server.app import create_app
from capture_proxy.server.settings import Settings
from capture_proxy.server.state import STATE
from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import chat_body, user


@pytest.mark.parametrize("prefix", ["", "/r/r9"])
async def test_passthrough_routes_are_not_captured(make_proxy: Any, prefix: str) -> None:
    p = await make_proxy()
    models = await p.client.get(f"{prefix}/v1/models")
    assert models.status == 200
    assert models.headers["X-Capture-Status"] == "not_captured"
    assert (await models.json())["data"][0]["id"] == "policy"
    version = await p.client.get(f"{prefix}/version")
    assert (await version.json()) == {"version": "0.32.0"}
    tok = await p.client.post(f"{prefix}/tokenize", json={"model": "policy", "prompt": "hi"})
    ids = (await tok.json())["tokens"]
    detok = await p.client.post(f"{prefix}/detokenize", json={"model": "policy", "tokens": ids})
    assert (await detok.json())["prompt"] == "hi"
    assert p.calls("r9") == []
    assert p.calls() == []


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),
        ("GET", "/admin"),
        ("POST", "/v2/chat"),
    ],
)
async def test_unknown_routes_are_404_json(make_proxy: Any, method: str, path: str) -> None:
    p = await make_proxy()
    resp = await p.client.request(method, path, json={})
    assert resp.status == 404
    err = (await resp.json())["error"]
    assert err["code"] == "route_not_found"
    assert path in err["message"]
    assert p.fake.requests == []


async def test_wrong_method_is_405_json(make_proxy: Any) -> None:
    p = await make_proxy()
    resp = await p.client.get("/v1/chat/completions")
    assert resp.status == 405
    assert (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_client_authorization_is_never_forwarded_upstream_key_is(
    make_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "sk-upstream-secret-123"
    p = await make_proxy(fake=FakeVLLM(api_key=secret), upstream_api_key=secret)
    resp = await p.chat(chat_body(user("x")), headers={"Authorization": "Bearer client-key"})
    assert resp.status == 200
    assert resp.headers["X-Capture-Status"] == "staged"
    body = await resp.text()
    models = await p.client.get("/v1/models", headers={"Authorization": "Bearer client-key"})
    assert models.status == 200
    assert secret not in body
    assert all(secret not in v for v in resp.headers.values())
    assert secret not in caplog.text
    metrics = await (await p.client.get("/metrics")).text()
    assert secret not in metrics
    # Nothing in the store holds the key either.
    with sqlite3.connect(p.store_url.removeprefix("sqlite:///")) as db:
        dump = "\n".join(db.iterdump())
    assert secret not in dump
    assert "client-key" not in dump


async def test_wrong_upstream_key_is_an_upstream_error(make_proxy: Any) -> None:
    p = await make_proxy(fake=FakeVLLM(api_key="right"), upstream_api_key="wrong")
    resp = await p.chat(chat_body(user("x")))
    assert resp.status == 401
    (entry,) = p.failures()
    assert entry.reason == "upstream_401"


async def test_health_ready_and_metrics(make_proxy: Any) -> None:
    p = await make_proxy()
    assert (await (await p.client.get("/healthz")).json()) == {"status": "ok"}
    ready = await p.client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["ready"] is True
    await p.chat(chat_body(user("x")))
    text = await (await p.client.get("/metrics")).text()
    for name in (
        "capture_proxy_requests_total",
        "capture_proxy_calls_total",
        "capture_proxy_request_duration_seconds_bucket",
        "capture_proxy_upstream_duration_seconds_bucket",
        "capture_proxy_stage_duration_seconds_bucket",
        "capture_proxy_staged_tokens_total",
        "capture_proxy_pending_stages",
        "capture_proxy_inflight_calls",
        "capture_proxy_ledger_held_entries",
        "capture_proxy_staged_records_total",
        "capture_proxy_staged_token_bytes_total",
        "capture_proxy_overhead_duration_seconds_bucket",
        "capture_proxy_sink_queue_depth",
        "capture_proxy_sink_batches_total",
        "capture_proxy_sink_last_batch_size",
        "capture_proxy_streams_open",
    ):
        assert name in text, name
    assert (
        'capture_proxy_requests_total{route="/r/{rollout_id}/v1/chat/completions",status="200"} 1.0'
        in text
    )


async def test_a_starting_proxy_says_how_long_its_store_took_to_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # What a restart spends opening the store (on object storage most of its time to ready)
    # is in the proxy's own log, so an operator need not guess it.
    caplog.set_level(logging.INFO, logger="capture_proxy")
    store = f"parquet:///{tmp_path}/ds"
    app = create_app(Settings(upstream="http://127.0.0.1:9", store=store))
    try:
        assert re.search(rf"store {re.escape(store)} opened in \d+\.\d\d s", caplog.text)
    finally:
        await app[STATE].sink.close()


async def test_readyz_fails_when_upstream_is_down(make_proxy: Any) -> None:
    p = await make_proxy(upstream="http://127.0.0.1:9")
    ready = await p.client.get("/readyz")
    assert ready.status == 503
    assert "upstream unreachable" in (await ready.json())["problems"][0]


async def test_disk_floor_stops_new_calls_and_readyz(make_proxy: Any) -> None:
    # A floor far above any real disk: the guard must refuse calls before they are forwarded.
    p = await make_proxy(min_free_disk_mb=2**40)
    import asyncio

    for _ in range(50):
        if p.state.capture.unavailable_reason:
            break
        await asyncio.sleep(0.05)
    resp = await p.chat(chat_body(user("x")))
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "5"
    assert "below the floor" in (await resp.json())["error"]["message"]
    assert p.fake.requests == []
    ready = await p.client.get("/readyz")
    assert ready.status == 503


async def test_inflight_limits_give_429(make_proxy: Any) -> None:
    import asyncio

    p = await make_proxy(fake=FakeVLLM(latency=0.5), max_inflight_per_rollout=1)
    first = asyncio.ensure_future(p.chat(chat_body(user("a"))))
    for _ in range(100):
        if p.state.capture.inflight:
            break
        await asyncio.sleep(0.01)
    second = await p.chat(chat_body(user("b")))
    assert second.status == 429
    assert second.headers["Retry-After"] == "1"
    other = await p.chat(chat_body(user("c")), rollout="other")
    assert other.status == 200
    assert (await first).status == 200


async def test_by_default_one_rollout_cannot_hold_a_thousand_calls(make_proxy: Any) -> None:
    # Issue 27: with the limit at 0 by default (and in no deploy file), one keyed rollout had
    # 1,000 streams admitted at once. The default now admits 16 of a rollout's calls at a time.
    import asyncio

    from capture_proxy.core.refusal_folds import folded_refusals

    p = await make_proxy(fake=FakeVLLM(latency=1.0))
    limit = p.state.capture.max_inflight_per_rollout
    assert limit == 16
    calls = [asyncio.ensure_future(p.chat(chat_body(user(f"{i}")))) for i in range(40)]
    answers = await asyncio.gather(*calls)
    statuses = sorted(a.status for a in answers)
    assert statuses == [200] * limit + [429] * (40 - limit)
    await asyncio.sleep(1.2)  # refusals past 16 in a second are one entry, written a second on
    refused = [f for f in p.failures() if f.http_status == 429]
    # Each refusal in the ledger, counted (core.refusal_folds): a visible gap.
    assert sum(folded_refusals(f) for f in refused) == 40 - limit


async def test_attachment_dedup_hits_are_counted(make_proxy: Any) -> None:
    import base64

    p = await make_proxy()
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"x" * 64).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}]
    for _ in range(3):
        await p.chat(chat_body({"role": "user", "content": content}))
    text = await (await p.client.get("/metrics")).text()
    assert "capture_proxy_sink_attachment_dedup_hits_total 2.0" in text
    assert "capture_proxy_attachments_total 3.0" in text
