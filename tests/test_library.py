"""The capture core as a library: the same exchange through the proxy and through CaptureClient
stages the same record (ids and timestamps aside)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from capture_proxy.core.policy import RequestPolicy
from capture_proxy.library import CaptureClient
from capture_proxy.schemas.digest import verify_record
from capture_proxy.schemas.request import RequestValidationError
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
from capture_proxy.upstream import HTTPUpstream
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
IDS_AND_TIMES = {"call_id", "created_at_ms", "digest", "parent_call_id", "retry_of"}


def _turns() -> list[Turn]:
    return [
        Turn("", reasoning="look", tool_calls=[FakeToolCall("bash", {"command": "ls"})]),
        Turn("done", reasoning="ok"),
    ]


def _logical(record: Any) -> dict[str, Any]:
    out = {}
    for name in record.__slots__:
        if name in IDS_AND_TIMES or name == "attachments":
            continue
        value = getattr(record, name)
        if name == "extras":
            value = {k: v for k, v in value.items() if k != "upstream_response_id"}
        out[name] = value.tobytes() if hasattr(value, "tobytes") else value
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_proxy_and_library_stage_identical_records(tmp_path: Path, stream: bool) -> None:
    policy: dict[str, Any] = {"policy_defaults": {"temperature": 0.5}, "max_tokens_cap": 64}
    first = chat_body(user("list files"), tools=TOOLS, tool_choice="auto", stream=stream)

    # Through the proxy.
    fake_a = FakeVLLM()
    fake_a.push(*_turns())
    proxy = await start_proxy(tmp_path / "proxy", fake=fake_a, **policy)
    try:
        await (await proxy.chat(first, rollout="ep")).read()
        via_proxy = proxy.calls("ep")
    finally:
        await stop_proxy(proxy)

    # Through the library, against an identical upstream.
    fake_b = FakeVLLM()
    fake_b.push(*_turns())
    upstream = TestServer(fake_b.app())
    await upstream.start_server()
    sink = open_sink(f"sqlite:///{tmp_path / 'lib.db'}")
    client = CaptureClient(
        sink, policy=RequestPolicy(defaults={"temperature": 0.5}, max_tokens_cap=64)
    )
    try:
        async with aiohttp.ClientSession() as http:
            base = str(upstream.make_url("")).rstrip("/")
            info = await HTTPUpstream(base, http).info("policy")
            call = await client.begin_call("ep", first)
            async with http.post(
                f"{base}/v1/chat/completions",
                data=call.body,
                headers={"Content-Type": "application/json"},
            ) as resp:
                assert resp.status == 200
                raw = await resp.read()
            result = await client.complete_call(call, raw, upstream=info)
            assert result.status == "staged"
            assert call.client_body is not None
            assert b"prompt_token_ids" not in call.client_body
    finally:
        await client.close()
        await upstream.close()
    source = open_source(f"sqlite:///{tmp_path / 'lib.db'}")
    via_library = source.calls("ep")
    source.close_reader()

    assert len(via_proxy) == len(via_library) == 1
    verify_record(via_library[0])
    assert _logical(via_proxy[0]) == _logical(via_library[0])


async def test_library_rejects_and_records_bad_requests(tmp_path: Path) -> None:
    sink = open_sink(f"sqlite:///{tmp_path / 'lib.db'}")
    client = CaptureClient(sink)
    with pytest.raises(RequestValidationError) as e:
        await client.begin_call(
            "ep", chat_body({"role": "user", "content": "x", "thinking_trace": 1})
        )
    assert e.value.param == "messages[0].thinking_trace"
    await client.close()
    source = open_source(f"sqlite:///{tmp_path / 'lib.db'}")
    (entry,) = source.failures("ep")
    assert entry.status == "rejected"
    assert entry.reason == "unknown_field"


async def test_library_missing_token_ids_is_capture_failed(tmp_path: Path) -> None:
    sink = open_sink(f"sqlite:///{tmp_path / 'lib.db'}")
    client = CaptureClient(sink)
    call = await client.begin_call("ep", chat_body(user("x")))
    body = orjson.loads(
        (Path(__file__).parent / "fixtures/vllm-0.32.0/chat-response.json").read_bytes()
    )
    del body["choices"][0]["token_ids"]
    body["choices"][0]["logprobs"] = None
    result = await client.complete_call(call, body)
    assert result.status == "capture_failed"
    assert result.reason == "missing_token_ids"
    assert client.capture.rollouts["ep"].poisoned
    await client.close()


async def test_an_answer_that_makes_an_invalid_record_is_capture_failed(tmp_path: Path) -> None:
    sink = open_sink(f"sqlite:///{tmp_path / 'lib.db'}")
    client = CaptureClient(sink)
    call = await client.begin_call("ep", chat_body(user("x")))
    body = orjson.loads(
        (Path(__file__).parent / "fixtures/vllm-0.32.0/chat-response.json").read_bytes()
    )
    body["choices"][0]["logprobs"]["content"][2]["logprob"] = 0.5  # not a log-probability
    result = await client.complete_call(call, body)
    assert result.status == "capture_failed"
    assert result.reason == "invalid_record"
    assert "completion_logprobs[2]" in (result.message or "")
    await client.close()
    source = open_source(f"sqlite:///{tmp_path / 'lib.db'}")
    assert source.calls("ep") == []
    (entry,) = source.failures("ep")
    assert entry.reason == "invalid_record"
