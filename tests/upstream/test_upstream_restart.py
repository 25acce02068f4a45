"""A new upstream process is noticed before the next call is sent, and its facts are used.

A restart on the same port is two fake vLLMs, one after the other, on one port: the proxy's
pooled connection to the first closes with it, and the next call opens a new one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import Proxy, chat_body, user

REASONED = [
    user("first"),
    {"role": "assistant", "content": "ok", "reasoning_content": "thought about it"},
    user("second"),
]


async def restart(p: Proxy, fake: FakeVLLM) -> None:
    """Stop the proxy's upstream and start `fake` on the same port."""
    port = p.upstream.port
    await p.upstream.close()
    p.upstream = TestServer(fake.app(), port=port)
    await p.upstream.start_server()
    p.fake = fake


async def test_a_restart_with_another_version_is_used_by_the_next_call(make_proxy: Any) -> None:
    p = await make_proxy(fake=FakeVLLM(version="0.32.0"))
    first = await p.chat(chat_body(*REASONED))
    assert first.headers["X-Capture-Status"] == "staged"
    assert "reasoning_content" in p.fake.requests[0]["messages"][1]

    old = FakeVLLM(version="0.18.0")  # reads replayed reasoning only as `reasoning`
    await restart(p, old)
    second = await p.chat(chat_body(*REASONED))
    assert second.headers["X-Capture-Status"] == "staged"

    [sent] = old.requests  # the call went once, planned for the new process
    assert sent["messages"][1]["reasoning"] == "thought about it"
    assert "reasoning_content" not in sent["messages"][1]
    records = p.calls()
    assert [r.upstream_version for r in records] == ["0.32.0", "0.18.0"]
    assert p.state.upstream.known.restarts_seen == 1


async def test_reused_connections_cost_no_fact_request(make_proxy: Any) -> None:
    fake = FakeVLLM()
    p = await make_proxy(fake=fake)
    resp = await p.chat(chat_body(user("x0")))
    assert resp.headers["X-Capture-Status"] == "staged"
    # The first call fetches the facts, then checks them when its chat connection opens (the
    # facts have their own small pool, so the chat pool holds only chat connections).
    asked = fake.route_hits["/version"]
    assert asked <= 2
    for i in range(1, 5):
        resp = await p.chat(chat_body(user(f"x{i}")))
        assert resp.headers["X-Capture-Status"] == "staged"
    # The others reuse the connection and ask nothing.
    assert fake.route_hits["/version"] == asked


async def test_a_restart_with_the_same_facts_sends_the_call_once(make_proxy: Any) -> None:
    p = await make_proxy(fake=FakeVLLM())
    await p.chat(chat_body(user("a")))
    same = FakeVLLM()
    await restart(p, same)
    resp = await p.chat(chat_body(user("b")))
    assert resp.headers["X-Capture-Status"] == "staged"
    assert len(same.requests) == 1
    assert p.state.upstream.known.restarts_seen == 0
    assert same.route_hits["/version"] == 1  # the check when the new connection opened


class FailingFacts(FakeVLLM):
    """A vLLM whose /version and /tokenize answer 500 until `healed`."""

    healed = False

    async def _version(self, request: web.Request) -> web.Response:
        if not self.healed:
            return web.json_response({"error": "boom"}, status=500)
        return await super()._version(request)

    async def _tokenize(self, request: web.Request) -> web.Response:
        if not self.healed:
            return web.json_response({"error": "boom"}, status=500)
        return await super()._tokenize(request)


async def test_a_failed_version_and_fingerprint_are_flagged_and_asked_again(
    make_proxy: Any,
) -> None:
    fake = FailingFacts()
    p = await make_proxy(fake=fake)
    p.state.upstream.known.retry_seconds = 0.2
    await p.chat(chat_body(user("a")))
    ready = await (await p.client.get("/readyz")).json()
    assert "upstream /version answered 500" in ready["problems"]  # as before: not ready
    assert any("/version answered 500" in w for w in ready["warnings"])
    assert any("no tokenizer fingerprint" in w for w in ready["warnings"])

    fake.healed = True
    await asyncio.sleep(0.3)
    await p.chat(chat_body(user("b")))
    first, second = p.calls()
    assert (first.upstream_version, first.tokenizer_fingerprint) == ("", "")
    problems = first.extras["upstream_fact_problems"]
    assert "upstream /version answered 500" in problems
    assert any("/tokenize answered 500: no tokenizer fingerprint" in x for x in problems)
    assert second.upstream_version == "0.32.0"
    assert second.tokenizer_fingerprint.startswith("sha256:")
    assert "upstream_fact_problems" not in second.extras
    ready = await (await p.client.get("/readyz")).json()
    assert ready["warnings"] == []
