"""vLLM's own weight version (``/weight_info``, dev mode) is recorded beside the driver's, with
one span over the completion when it did not change during the call."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from capture_proxy.testing.fake_vllm import FakeVLLM
from capture_proxy.upstream import HTTPUpstream
from tests.support.proxy_harness import chat_body, user


async def test_the_engine_weight_version_is_read_for_each_call_the_first_after_an_update_too(
    make_proxy: Any,
) -> None:
    fake = FakeVLLM(dev_mode=True)
    p = await make_proxy(fake=fake)
    await p.chat(chat_body(user("a")))
    fake.weight_version = "step-7"  # a weight update between calls, not through the proxy
    await p.chat(chat_body(user("b")))
    await p.chat(chat_body(user("c")))
    first, second, third = p.calls()
    n = len(first.completion_token_ids)
    assert (first.engine_weight_version, first.weight_spans) == ("default", (("default", 0, n),))
    # Read for the second call itself, not taken from the read after the first one.
    for record in (second, third):
        n = len(record.completion_token_ids)
        assert (record.engine_weight_version, record.weight_spans) == (
            "step-7",
            (("step-7", 0, n),),
        )


async def test_weights_that_change_during_a_call_leave_its_engine_version_unknown(
    make_proxy: Any,
) -> None:
    fake = FakeVLLM(dev_mode=True, latency=0.3)
    p = await make_proxy(fake=fake)
    call = asyncio.ensure_future(p.chat(chat_body(user("a"))))
    await asyncio.sleep(0.15)  # the call is at the engine
    fake.weight_version = "step-8"
    await call
    (record,) = p.calls()
    # Read as "default" before the call and "step-8" after it: unknown, not guessed.
    assert (record.engine_weight_version, record.weight_spans) == (None, ())


async def test_without_dev_mode_nothing_is_asked_per_call(make_proxy: Any) -> None:
    fake = FakeVLLM()
    p = await make_proxy(fake=fake)
    for text in ("a", "b", "c"):
        await p.chat(chat_body(user(text)))
    assert fake.route_hits["/weight_info"] == 1  # asked once: 404, not served
    assert all((r.engine_weight_version, r.weight_spans) == (None, ()) for r in p.calls())


async def test_the_first_call_after_a_resume_with_a_version_knows_the_engines_version(
    make_proxy: Any,
) -> None:
    # The proxy itself pushed the version to vLLM: the call after the resume was sampled by it.
    fake = FakeVLLM(dev_mode=True)
    token = "admin-token-engine-weights-0123"
    admin = {"Authorization": f"Bearer {token}"}
    p = await make_proxy(fake=fake, admin_token=token)
    await p.chat(chat_body(user("before")))
    assert (await p.client.post("/admin/weights/pause", headers=admin)).status == 200
    body = {"weight_version": 1}
    resumed = await p.client.post("/admin/weights/resume", json=body, headers=admin)
    assert (await resumed.json())["engine"] == "updated"
    await p.chat(chat_body(user("after")))
    before, after = p.calls()
    assert before.engine_weight_version == "default"
    n = len(after.completion_token_ids)
    assert (after.engine_weight_version, after.weight_spans) == ("1", (("1", 0, n),))
    assert (after.weight_version, before.weight_version) == (1, 0)


class SlowWeightInfo(FakeVLLM):
    """A dev-mode fake whose ``/weight_info`` takes 50 ms and counts the reads in flight."""

    def __init__(self) -> None:
        super().__init__(dev_mode=True)
        self.in_flight = self.most_in_flight = 0

    async def _weight_info(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        version = self.weight_version  # what the engine holds when the read arrives
        await asyncio.sleep(0.05)
        self.in_flight -= 1
        self.route_hits[request.path] += 1
        return web.json_response({"weight_version": version})


async def test_a_burst_of_calls_shares_reads_and_each_read_starts_after_its_caller_asked() -> None:
    fake = SlowWeightInfo()
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    upstream = HTTPUpstream(str(server.make_url("")))
    try:
        first = asyncio.ensure_future(upstream.read_engine_weight_version())
        await asyncio.sleep(0.02)  # that read is at the engine
        fake.weight_version = "step-2"
        # Asked after the change: none of these may get the read already in flight.
        burst = await asyncio.gather(*(upstream.read_engine_weight_version() for _ in range(20)))
        assert await first == "default"
        assert burst == ["step-2"] * 20
        assert fake.route_hits["/weight_info"] == 2  # 21 callers, two reads
        assert fake.most_in_flight == 1
    finally:
        await upstream.close()
        await server.close()
