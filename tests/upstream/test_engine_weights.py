"""vLLM's own weight version (``/weight_info``, dev mode) is recorded beside the driver's, with
one span over the completion when it did not change during the call."""

from __future__ import annotations

from typing import Any

from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import chat_body, user


async def test_the_engine_weight_version_is_recorded_with_its_span(make_proxy: Any) -> None:
    fake = FakeVLLM(dev_mode=True)
    p = await make_proxy(fake=fake)
    await p.chat(chat_body(user("a")))
    fake.weight_version = "step-7"  # a weight update between calls
    await p.chat(chat_body(user("b")))
    await p.chat(chat_body(user("c")))
    first, second, third = p.calls()
    n = len(first.completion_token_ids)
    assert (first.engine_weight_version, first.weight_spans) == ("default", (("default", 0, n),))
    # Read as "default" before the second call and "step-7" after it: unknown, not guessed.
    assert (second.engine_weight_version, second.weight_spans) == (None, ())
    n = len(third.completion_token_ids)
    assert (third.engine_weight_version, third.weight_spans) == ("step-7", (("step-7", 0, n),))


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
