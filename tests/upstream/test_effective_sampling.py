"""The sampling vLLM applied is recorded: the request's keys over the model's own defaults,
read once per upstream process from a probe render; unknown (None) where the route is absent."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from capture_proxy.core.sampling import changes_distribution, effective_sampling
from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support.proxy_harness import chat_body, user

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


async def test_a_call_without_temperature_records_the_models_defaults(make_proxy: Any) -> None:
    fake = FakeVLLM(scale_out=True, generation_config=QWEN3)
    p = await make_proxy(fake=fake)
    await p.chat(chat_body(user("a"), max_tokens=8))
    # The facts are fetched once, and checked once more when the first chat connection opens.
    probes = fake.route_hits["/v1/chat/completions/render"]
    assert probes <= 2
    for text in ("b", "c"):
        await p.chat(chat_body(user(text), max_tokens=8))
    await p.chat(chat_body(user("d"), temperature=1.0, top_k=None, presence_penalty=0.5))
    first, *_, last = p.calls()
    assert first.sampling == {"max_tokens": 8}
    assert first.effective_sampling == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": 8,
    }
    # The request's keys win; a null one leaves the default (as vLLM reads it).
    assert last.effective_sampling is not None
    assert last.effective_sampling["temperature"] == 1.0
    assert last.effective_sampling["top_k"] == 20
    assert last.effective_sampling["presence_penalty"] == 0.5
    # Later calls reuse their connection: no probe per call.
    assert fake.route_hits["/v1/chat/completions/render"] == probes


async def test_without_the_render_route_the_effective_sampling_is_unknown(
    make_proxy: Any,
) -> None:
    fake = FakeVLLM(generation_config=QWEN3)  # no --enable-scale-out: the route answers 403
    p = await make_proxy(fake=fake)
    await p.chat(chat_body(user("a"), temperature=0.7))
    [record] = p.calls()
    assert record.effective_sampling is None
    assert record.sampling == {"temperature": 0.7}


async def test_raw_logprobs_under_the_models_defaults_warn_in_readyz(
    make_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeVLLM(scale_out=True, generation_config=QWEN3)
    with caplog.at_level(logging.WARNING):
        p = await make_proxy(fake=fake, upstream_logprobs_mode="raw_logprobs")
        before = await (await p.client.get("/readyz")).json()
        await p.chat(chat_body(user("a")))
    assert "upstream logprobs mode is raw_logprobs" in caplog.text  # at start
    assert before["warnings"] == []
    ready = await (await p.client.get("/readyz")).json()
    assert ready["ready"] is True  # a warning, not a failure
    [warning] = ready["warnings"]
    assert "logprobs mode is raw_logprobs" in warning
    assert "temperature=0.6" in warning
    assert "top_k=20" in warning
    assert "--logprobs-mode processed_logprobs" in warning
    assert p.calls()[0].logprobs_mode == "raw_logprobs"


async def test_processed_logprobs_or_a_neutral_sampling_do_not_warn(make_proxy: Any) -> None:
    fake = FakeVLLM(scale_out=True, generation_config=QWEN3)
    p = await make_proxy(fake=fake, upstream_logprobs_mode="processed_logprobs")
    await p.chat(chat_body(user("a")))
    assert (await (await p.client.get("/readyz")).json())["warnings"] == []

    neutral = await make_proxy(fake=FakeVLLM(scale_out=True))  # no generation config
    await neutral.chat(chat_body(user("a")))
    assert (await (await neutral.client.get("/readyz")).json())["warnings"] == []


def test_a_greedy_temperature_resets_the_truncations() -> None:
    out = effective_sampling({"temperature": 0}, QWEN3)
    assert out == {"temperature": 0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    assert changes_distribution(out) == ["temperature=0"]
    assert effective_sampling({"temperature": 0}, None) is None
