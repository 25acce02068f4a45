"""Token-in calls with several vLLM replicas: each rollout's renders, generate and derender go
to the replica it is pinned to, and its calls still continue one another exactly."""

from __future__ import annotations

from pathlib import Path

from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.server.test_token_in_flow import assert_extends
from tests.support.proxy_harness import chat_body, stop_proxy, user
from tests.support.replicas import Fleet, start_fleet_proxy

ENGINE_ROUTES = (
    "/v1/chat/completions/render",
    "/inference/v1/generate",
    "/v1/chat/completions/derender",
)


async def test_a_rollouts_token_in_calls_go_to_its_replica(tmp_path: Path, fleet: Fleet) -> None:
    urls = [await fleet.add(FakeVLLM(scale_out=True, drop_past_reasoning=True)) for _ in range(2)]
    p = await start_fleet_proxy(tmp_path, fleet, token_in="on")
    try:
        probed = {url: fleet.fakes[url].route_hits[ENGINE_ROUTES[0]] for url in urls}
        for rollout in ("a", "b"):
            messages = [user("One.")]
            resp = await p.chat(chat_body(*messages), rollout=rollout)
            assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
            answer = (await resp.json())["choices"][0]["message"]
            replayed = {"role": "assistant", "content": answer["content"]}
            replayed["reasoning"] = answer["reasoning"]
            resp = await p.chat(chat_body(*messages, replayed, user("Two.")), rollout=rollout)
            assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
        pinned = {}
        for rollout in ("a", "b"):
            records = p.calls(rollout)
            assert_extends(records)
            [replica] = {r.replica for r in records}
            pinned[rollout] = replica
        assert sorted(pinned.values()) == sorted(urls)  # one rollout on each replica
        for url in urls:
            hits = fleet.fakes[url].route_hits
            assert hits["/inference/v1/generate"] == 2  # its rollout's two calls, no other
            assert hits[ENGINE_ROUTES[0]] > probed[url]
            assert hits[ENGINE_ROUTES[2]] == 2
    finally:
        await stop_proxy(p)
