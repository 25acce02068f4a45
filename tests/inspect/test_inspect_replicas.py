"""`capture-proxy inspect http://HOST:PORT` on a running proxy shows its upstream replicas.

A real proxy fronts two fake vLLM replicas on loopback, one of which serves another model (or
goes away); `inspect` reads the proxy over HTTP on a thread (its client is synchronous) while the
proxy's event loop keeps serving, and its output is checked as a person and a script see it.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from capture_proxy.inspect.cli import main
from capture_proxy.read.reader import open_store
from capture_proxy.sinks.remote import WIRE_VERSION, RemoteSource
from tests.support import ROOT
from tests.support.proxy_harness import Proxy, ProxyFactory, chat_body, stop_proxy, user
from tests.support.replicas import Fleet, OtherTemplate, replicas_of, start_fleet_proxy, until

ADMIN_TOKEN = "admin-token-for-inspect-0123"
READER_TOKEN = "reader-token-for-inspect-4567"


@pytest.fixture(autouse=True)
def reader_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """`inspect` takes the token from the environment, as a person running it would give it."""
    monkeypatch.setenv("CAPTURE_PROXY_READER_TOKEN", READER_TOKEN)


def url_of(p: Proxy) -> str:
    return str(p.client.make_url("")).rstrip("/")


async def inspect(*argv: str) -> tuple[int, str]:
    """`inspect` in-process on a thread, so the proxy on this event loop answers it."""

    def run() -> tuple[int, str]:
        buf = io.StringIO()
        return main(list(argv), stdout=buf), buf.getvalue()

    return await asyncio.to_thread(run)


async def fleet_proxy(tmp_path: Path, fleet: Fleet) -> Proxy:
    return await start_fleet_proxy(
        tmp_path, fleet, admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN
    )


async def test_a_quarantined_replica_is_shown_with_its_reason(tmp_path: Path, fleet: Fleet) -> None:
    # Two of three agree: the third serves "another model" (no majority would hold them all).
    good = await fleet.add()
    other = await fleet.add(OtherTemplate())
    spare = await fleet.add()
    p = await fleet_proxy(tmp_path, fleet)
    try:
        assert replicas_of(p).by_name[other].state == "quarantined"
        resp = await p.chat(chat_body(user("hi")), rollout="r1")
        assert resp.headers["X-Capture-Status"] == "staged"
        placed = p.calls("r1")[0].replica
        assert placed in (good, spare)
        live = {good: "1" if placed == good else "0", spare: "1" if placed == spare else "0"}

        code, text = await inspect(url_of(p))
        assert code == 0, text
        lines = text.splitlines()
        assert lines[0] == f"1 rollout(s) in {url_of(p)}, newest first"
        at = lines.index("3 upstream replica(s) behind the proxy, 1 not healthy")
        assert lines[at + 1].split() == ["REPLICA", "STATE", "LIVE", "ROLLOUTS", "PROBLEM"]
        assert lines[at + 2].split() == [good, "healthy", live[good], "-"]
        row = lines[at + 3]
        assert row.split()[:3] == [other, "quarantined", "0"]
        assert "tokenizer fingerprint sha256:" in row
        assert lines[at + 4].split() == [spare, "healthy", live[spare], "-"]
        assert len(lines) == at + 5

        code, text = await inspect(url_of(p), "--json")
        assert code == 0, text
        by_name = {r["replica"]: r for r in orjson.loads(text)["replicas"]}
        assert by_name[good]["state"] == "healthy"
        assert by_name[good]["problem"] == ""
        assert by_name[good]["live_rollouts"] == int(live[good])
        assert by_name[good]["fingerprint"].startswith("sha256:")
        assert by_name[other]["state"] == "quarantined"
        assert by_name[other]["problem"].startswith("tokenizer fingerprint sha256:")
        assert by_name[other]["fingerprint"] != by_name[good]["fingerprint"]
        docs = (ROOT / "docs" / "inspect.md").read_text()
        assert [k for k in by_name[good] if f"| `{k}` |" not in docs] == []
    finally:
        await stop_proxy(p)


async def test_a_replica_that_went_away_is_shown_unreachable(tmp_path: Path, fleet: Fleet) -> None:
    a, b = await fleet.add(), await fleet.add()
    p = await fleet_proxy(tmp_path, fleet)
    try:
        await fleet.stop(b)
        await until(lambda: replicas_of(p).by_name[b].state == "unreachable")
        code, text = await inspect(url_of(p))
        assert code == 0, text
        lines = text.splitlines()
        assert lines[:2] == [f"0 rollout(s) in {url_of(p)}, newest first", "(no rollouts yet)"]
        assert lines[2] == "2 upstream replica(s) behind the proxy, 1 not healthy"
        assert lines[4].split() == [a, "healthy", "0", "-"]
        assert lines[5].split()[:3] == [b, "unreachable", "0"]
        assert "cannot reach the upstream" in lines[5]  # why, as the probe found it
    finally:
        await stop_proxy(p)


async def test_a_single_upstream_shows_no_replicas(make_proxy: ProxyFactory) -> None:
    p = await make_proxy(admin_token=ADMIN_TOKEN, reader_token=READER_TOKEN)
    code, text = await inspect(url_of(p))
    assert code == 0, text
    assert text == f"0 rollout(s) in {url_of(p)}, newest first\n(no rollouts yet)\n"
    code, text = await inspect(url_of(p), "--json")
    assert orjson.loads(text)["replicas"] == []
    # The route itself: the reader token reads it, no token does not.
    reader = {"Authorization": f"Bearer {READER_TOKEN}"}
    assert await (await p.client.get("/admin/store/replicas", headers=reader)).json() == []
    refused = await p.client.get("/admin/store/replicas")
    assert refused.status == 401
    assert (await refused.json())["error"]["code"] == "reader_token"


async def test_a_store_read_from_files_has_no_replicas_key(tmp_path: Path, fleet: Fleet) -> None:
    await fleet.add()
    await fleet.add()
    p = await fleet_proxy(tmp_path, fleet)
    try:
        await p.chat(chat_body(user("hi")), rollout="r1")
    finally:
        await stop_proxy(p)
    code, text = await inspect(p.store_url, "--json")
    assert code == 0, text
    assert "replicas" not in orjson.loads(text)
    code, text = await inspect(p.store_url)
    assert "replica" not in text


@pytest.fixture
async def old_proxy() -> AsyncIterator[str]:
    """A proxy from before the replicas route: its store routes answer, that one is unknown."""

    async def about(request: web.Request) -> web.Response:
        return web.json_response({"store": "sqlite:///old.db", "wire_version": WIRE_VERSION})

    async def rollouts(request: web.Request) -> web.Response:
        return web.json_response([])

    @web.middleware
    async def not_found(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except web.HTTPNotFound:
            body = {"error": {"message": "not a route", "code": "route_not_found"}}
            return web.json_response(body, status=404)

    app = web.Application(middlewares=[not_found])
    app.router.add_get("/admin/store", about)
    app.router.add_get("/admin/store/rollouts", rollouts)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


async def test_a_proxy_too_old_to_report_replicas_is_inspected_quietly(old_proxy: str) -> None:
    def replicas() -> Any:
        with open_store(old_proxy) as store:
            assert isinstance(store.source, RemoteSource)
            return store.source.replicas()

    assert await asyncio.to_thread(replicas) is None
    code, text = await inspect(old_proxy)
    assert (code, text) == (0, f"0 rollout(s) in {old_proxy}, newest first\n(no rollouts yet)\n")
    code, text = await inspect(old_proxy, "--json")
    assert "replicas" not in orjson.loads(text)
