"""Routed experts (vLLM's ``--enable-return-routed-experts``) are staged in the record's extras
and never relayed to the client, plain and streamed."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from capture_proxy.testing.fake_vllm import FakeVLLM, experts_for, read_experts
from tests.support.proxy_harness import chat_body, sse_lines, user


@pytest.mark.parametrize("stream", [False, True])
async def test_routed_experts_are_staged_not_relayed(make_proxy: Any, stream: bool) -> None:
    p = await make_proxy(fake=FakeVLLM(routed_experts=True))
    resp = await p.chat(chat_body(user("hello"), stream=stream))
    assert resp.headers["X-Capture-Status"] == "staged" or stream
    body = b"\n".join([line async for line in sse_lines(resp)])
    assert b"routed_experts" not in body
    if not stream:
        assert "routed_experts" not in orjson.loads(body)["choices"][0]
    (record,) = p.calls()
    ids = [*record.prompt_token_ids, *record.completion_token_ids]
    _, values = read_experts(record.extras["routed_experts"])
    assert values == experts_for(ids)
