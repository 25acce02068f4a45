"""What hostile sandboxes and careless operators get (issue 19, the minor findings).

Each test here failed on the code the issue was filed against: un-prefixed pass-through routes
without a key, pass-through bodies up to the chat limit, a non-ASCII bearer token (500), over-long
URLs (a traceback each), a sealed keyed rollout answering its own key with 403, refusals of new
rollout ids held in memory past the live-rollout cap, client-chosen model names pinned in memory,
a hanging upstream ``/version`` holding every call, a trickling upstream without a total deadline,
weak admin tokens, and a chat route taking any ``Content-Type``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from capture_proxy.server.settings import SettingsError, add_arguments, load_settings, token_bits
from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import Proxy, chat_body, user

TOKEN = "admin-token-for-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def keyed(make_proxy: Any, **settings: Any) -> tuple[Proxy, str]:
    p: Proxy = await make_proxy(admin_token=TOKEN, require_rollout_keys=True, **settings)
    resp = await p.client.post("/admin/rollouts", json={"rollout_id": "A"}, headers=ADMIN)
    assert resp.status == 201
    return p, (await resp.json())["api_key"]


async def raw_request(p: Proxy, head: bytes) -> tuple[int, bytes]:
    port = p.client.port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        async with asyncio.timeout(10):
            raw = await reader.read()
    finally:
        writer.close()
    status_line, _, body = raw.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), body


# -- pass-through routes ----------------------------------------------------------------------

UNPREFIXED = [
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("POST", "/tokenize", {"model": "policy", "prompt": "hi"}),
    ("POST", "/detokenize", {"model": "policy", "tokens": [104, 105]}),
]


@pytest.mark.parametrize(("method", "route", "body"), UNPREFIXED)
async def test_unprefixed_pass_through_routes_need_the_named_rollouts_key(
    make_proxy: Any, method: str, route: str, body: Any
) -> None:
    p, key = await keyed(make_proxy)
    nothing = await p.client.request(method, route, json=body)
    assert nothing.status == 401
    assert (await nothing.json())["error"]["code"] == "missing_rollout_key"
    unnamed = await p.client.request(method, route, json=body, headers=bearer(key))
    assert unnamed.status == 403  # a key, but no rollout named: whose key would it be?
    named = await p.client.request(
        method, route, json=body, headers={**bearer(key), "X-Rollout-Id": "A"}
    )
    assert named.status == 200
    assert named.headers["X-Capture-Status"] == "not_captured"


@pytest.mark.parametrize("prefix", ["", "/r/A"])
async def test_pass_through_bodies_have_their_own_small_limit(make_proxy: Any, prefix: str) -> None:
    p = await make_proxy(max_passthrough_body_bytes=1000)
    small = {"model": "policy", "prompt": "hi"}
    assert (await p.client.post(prefix + "/tokenize", json=small)).status == 200
    big = {"model": "policy", "prompt": "x" * 2000}
    resp = await p.client.post(prefix + "/tokenize", json=big)
    assert resp.status == 413
    error = (await resp.json())["error"]
    assert error["code"] == "body_too_large"
    assert "--max-passthrough-body-bytes" in error["message"]

    # Without a Content-Length (chunked), the limit holds while reading.
    async def chunks() -> Any:
        for _ in range(4):
            yield b"x" * 600

    resp = await p.client.post(prefix + "/detokenize", data=chunks(), headers=JSON)
    assert resp.status == 413
    assert not any("x" * 2000 in str(r) for r in p.fake.requests)


# -- tokens and URLs --------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/r/A/v1/chat/completions", "/admin/rollouts"])
async def test_a_non_ascii_bearer_token_is_refused_cleanly(make_proxy: Any, route: str) -> None:
    p, _ = await keyed(make_proxy)
    body = orjson.dumps(chat_body(user("x")))
    head = (
        (
            f"POST {route} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        ).encode()
        + b"Authorization: Bearer \xc3\xa9t\xe9\xff\r\n\r\n"
        + body
    )
    status, raw = await raw_request(p, head)
    assert status in (401, 403)
    assert orjson.loads(raw)["error"]["code"] in ("wrong_rollout_key", "admin_token")
    assert p.fake.requests == []


async def test_an_over_long_url_is_one_clean_log_line(
    make_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p = await make_proxy()
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        status, _ = await raw_request(
            p, b"GET /v1/models?" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert status in (400, 414)
    refused = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(refused) == 3
    for r in refused:
        assert r.exc_info is None
        assert r.exc_text is None
        assert "\n" not in r.getMessage()
        assert len(r.getMessage()) < 300


# -- sealed keyed rollouts --------------------------------------------------------------------


async def test_a_sealed_keyed_rollout_answers_its_own_key_with_409(make_proxy: Any) -> None:
    p, key = await keyed(make_proxy)
    assert (await p.chat(chat_body(user("x")), rollout="A", headers=bearer(key))).status == 200
    assert (await p.client.post("/admin/rollouts/A/seal", headers=ADMIN)).status == 200
    for _ in range(2):  # the first from the seal's memory, then again
        resp = await p.chat(chat_body(user("y")), rollout="A", headers=bearer(key))
        assert resp.status == 409
        assert (await resp.json())["error"]["code"] == "rollout_sealed"
    p.state.capture._sealed.clear()  # forgotten: resolved from the store
    resp = await p.chat(chat_body(user("y")), rollout="A", headers=bearer(key))
    assert resp.status == 409
    wrong = await p.chat(chat_body(user("y")), rollout="A", headers=bearer("not-the-key"))
    assert wrong.status == 403


# -- memory held for hostile input ------------------------------------------------------------


async def test_refusals_of_new_rollout_ids_stay_under_the_live_rollout_cap(
    make_proxy: Any,
) -> None:
    p = await make_proxy()
    cap = p.state.capture
    cap.max_live_rollouts = 20
    for i in range(120):
        resp = await p.client.post(
            f"/r/new-{i}/v1/chat/completions", data=b"{not json", headers=JSON
        )
        assert resp.status == 400
        assert len(cap.rollouts) <= 20
    # Rollouts made only of refusals are idle like any other, and leave memory.
    cap.evict_idle(0.0)
    assert len(cap.rollouts) == 0
    # Nothing was lost: each refusal is in its rollout's ledger, and a released rollout
    # resumes after its refusal.
    assert [f.seq for f in p.failures("new-0")] == [0]
    resp = await p.chat(chat_body(user("x")), rollout="new-0")
    assert resp.status == 200
    assert [c.seq for c in p.calls("new-0")] == [1]


async def test_client_chosen_model_names_are_not_pinned_in_memory(make_proxy: Any) -> None:
    p = await make_proxy(served_model="")
    for i in range(80):
        await p.chat(chat_body(user("x"), model=f"m{i}"))
    assert len(p.state.upstream.known.models) <= 32


# -- upstream deadlines -----------------------------------------------------------------------


class HangingFacts(FakeVLLM):
    """A vLLM whose /version and /tokenize never answer (chat still works)."""

    async def _version(self, request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def _tokenize(self, request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


async def test_a_hanging_upstream_version_holds_no_call_hostage(make_proxy: Any) -> None:
    p = await make_proxy(fake=HangingFacts(), upstream_first_byte_timeout=30.0)
    p.state.upstream.fact_timeout = 0.5
    t0 = time.monotonic()
    answers = await asyncio.gather(
        *(p.chat(chat_body(user(f"x{i}")), rollout=f"r{i}") for i in range(5))
    )
    assert [a.status for a in answers] == [200] * 5
    assert time.monotonic() - t0 < 5.0
    assert all(a.headers["X-Capture-Status"] == "staged" for a in answers)


async def test_a_trickling_stream_meets_the_total_deadline(make_proxy: Any) -> None:
    fake = FakeVLLM(chunk_delay=0.2)
    p = await make_proxy(fake=fake, upstream_total_timeout=1.0, upstream_idle_timeout=5.0)
    t0 = time.monotonic()
    resp = await p.chat(chat_body(user("x"), stream=True, max_tokens=200))
    raw = await resp.read()
    assert time.monotonic() - t0 < 5.0
    assert b"upstream_deadline" in raw
    assert b"[DONE]" not in raw
    [failure] = p.failures()
    assert (failure.status, failure.reason) == ("upstream_error", "upstream_deadline")
    assert "--upstream-total-timeout" in failure.message


async def test_a_trickling_unary_answer_meets_the_total_deadline(make_proxy: Any) -> None:
    async def trickle(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        await out.prepare(request)
        for _ in range(100):  # a byte every 0.1 s: never idle, never done
            await out.write(b" ")
            await asyncio.sleep(0.1)
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", trickle)
    server = TestServer(app)
    await server.start_server()
    try:
        p = await make_proxy(
            upstream=str(server.make_url("")).rstrip("/"),
            upstream_total_timeout=1.0,
            upstream_idle_timeout=5.0,
        )
        t0 = time.monotonic()
        resp = await p.chat(chat_body(user("x")))
        assert time.monotonic() - t0 < 5.0
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "upstream_deadline"
        [failure] = p.failures()
        assert (failure.status, failure.reason) == ("upstream_error", "upstream_deadline")
    finally:
        await server.close()


# -- admin tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    [
        "t",
        "short-token",
        "changeme-changeme",
        "replace-with-a-random-token",
        "a" * 40,
        # Issue 27: accepted before. Refused by estimated entropy (`token_bits`), not by a list.
        "0123456789abcdef",
        "password12345678",
        "abcdefghijklmnopqrstuvwxyz",
        "1111222233334444",
        "9876543210zyxwvu",
    ],
)
def test_weak_or_placeholder_admin_tokens_are_refused_at_start(token: str) -> None:
    with pytest.raises(SettingsError, match="admin-token"):
        load_settings(environ={"CAPTURE_PROXY_ADMIN_TOKEN": token})
    with pytest.raises(SettingsError, match="reader-token"):
        load_settings(
            environ={"CAPTURE_PROXY_ADMIN_TOKEN": TOKEN, "CAPTURE_PROXY_READER_TOKEN": token}
        )


@pytest.mark.parametrize("seed", range(20))
def test_random_tokens_as_the_docs_make_them_are_taken(seed: int) -> None:
    token = random.Random(seed).randbytes(32).hex()  # what `openssl rand -hex 32` prints
    assert token_bits(token) > 128
    assert load_settings(environ={"CAPTURE_PROXY_ADMIN_TOKEN": token}).admin_token == token


def test_an_admin_token_on_the_command_line_is_taken_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with caplog.at_level(logging.WARNING, logger="capture_proxy"):
        settings = load_settings(parser.parse_args(["--admin-token", TOKEN]), environ={})
    assert settings.admin_token == TOKEN
    (said,) = [r.getMessage() for r in caplog.records if "command line" in r.getMessage()]
    assert "--admin-token" in said
    assert "CAPTURE_PROXY_ADMIN_TOKEN" in said
    assert TOKEN not in said  # the warning does not print it again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="capture_proxy"):
        load_settings(environ={"CAPTURE_PROXY_ADMIN_TOKEN": TOKEN})
    assert not [r for r in caplog.records if "command line" in r.getMessage()]


def test_the_admin_token_is_read_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    settings = load_settings(environ={"CAPTURE_PROXY_ADMIN_TOKEN_FILE": str(path)})
    assert settings.admin_token == TOKEN
    with pytest.raises(SettingsError, match="admin-token-file"):
        load_settings(environ={"CAPTURE_PROXY_ADMIN_TOKEN_FILE": str(tmp_path / "missing")})
    both = {"CAPTURE_PROXY_ADMIN_TOKEN_FILE": str(path), "CAPTURE_PROXY_ADMIN_TOKEN": TOKEN}
    with pytest.raises(SettingsError, match="not both"):
        load_settings(environ=both)


# -- content type -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
async def test_the_chat_route_wants_json(make_proxy: Any, content_type: str | None) -> None:
    p = await make_proxy()
    headers = {"Content-Type": content_type} if content_type else {}
    body = orjson.dumps(chat_body(user("x")))
    resp = await p.client.post(
        "/r/r1/v1/chat/completions", data=body, headers=headers, skip_auto_headers=["Content-Type"]
    )
    assert resp.status == 415
    error = (await resp.json())["error"]
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"]
    assert p.fake.requests == []
    [failure] = p.failures()
    assert (failure.status, failure.reason, failure.http_status) == (
        "rejected",
        "unsupported_media_type",
        415,
    )


async def test_json_with_a_charset_is_accepted(make_proxy: Any) -> None:
    p = await make_proxy()
    resp = await p.client.post(
        "/r/r1/v1/chat/completions",
        data=orjson.dumps(chat_body(user("x"))),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert resp.status == 200


# -- a store gone under the control API ---------------------------------------------------------


async def test_the_control_api_answers_503_when_the_sqlite_file_was_deleted(
    make_proxy: Any,
) -> None:
    # Issue 27: POST /admin/rollouts answered 500 with a traceback.
    p = await make_proxy(admin_token=TOKEN)
    await asyncio.to_thread(Path(p.store_url.removeprefix("sqlite:///")).unlink)
    resp = await p.client.post("/admin/rollouts", json={"rollout_id": "A"}, headers=ADMIN)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "5"
    error = (await resp.json())["error"]
    assert error["code"] == "store_unavailable"
    assert "was deleted or moved away" in error["message"]
