"""The OpenAI Python SDK as a real client of the proxy: streaming and not, tool calls, retries."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus
from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Fault, Turn

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def _client(p: Any, rollout: str, **kwargs: Any) -> openai.AsyncOpenAI:
    base = str(p.client.make_url(f"/r/{rollout}/v1"))
    return openai.AsyncOpenAI(base_url=base, api_key="sandbox-key", **kwargs)


async def test_sdk_tool_call_round_trip_non_streaming(make_proxy: Any) -> None:
    fake = FakeVLLM()
    fake.push(Turn("", tool_calls=[FakeToolCall("bash", {"command": "ls"})]), Turn("two files"))
    p = await make_proxy(fake=fake)
    sdk = _client(p, "sdk")
    messages: list[Any] = [{"role": "user", "content": "list files"}]
    raw = await sdk.chat.completions.with_raw_response.create(
        model="policy", messages=messages, tools=TOOLS
    )
    assert raw.headers["x-capture-status"] == "staged"
    first = raw.parse()
    tool_calls = first.choices[0].message.tool_calls
    assert tool_calls is not None
    call = tool_calls[0]
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.function.name == "bash"
    assert json.loads(call.function.arguments) == {"command": "ls"}
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "a b"},
    ]
    second = await sdk.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "two files"
    r1, r2 = p.calls("sdk")
    assert r2.parent_call_id == r1.call_id
    assert list(r1.completion_token_ids) == p.fake.responses[0]["completion_token_ids"]
    assert list(r2.prompt_token_ids) == p.fake.responses[1]["prompt_token_ids"]


async def test_sdk_streaming_with_usage(make_proxy: Any) -> None:
    p = await make_proxy()
    sdk = _client(p, "sdk")
    stream = await sdk.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "hello there"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    (record,) = p.calls("sdk")
    assert text == record.response["content"]
    assert usage is not None
    assert usage.completion_tokens == len(record.completion_token_ids)


async def test_sdk_retry_after_a_5xx_is_counted_once(make_proxy: Any) -> None:
    fake = FakeVLLM()
    fake.push(Turn(fault=Fault.http_error(503, {"error": {"message": "busy"}})), Turn("ok now"))
    p = await make_proxy(fake=fake)
    sdk = _client(p, "sdk", max_retries=2)
    done = await sdk.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "q"}]
    )
    assert done.choices[0].message.content == "ok now"
    (failure,) = p.failures("sdk")
    (record,) = p.calls("sdk")
    assert failure.status is CallStatus.UPSTREAM_ERROR
    assert failure.http_status == 503
    assert record.retry_of == failure.call_id  # linked to the attempt it repeats
    with open_store(p.store_url) as store:
        traj = store.trajectory("sdk", include_open=True)
    assert traj.calls == [record.call_id]
    assert sum(traj.loss_mask) == len(record.completion_token_ids)


async def test_sdk_retry_of_a_staged_call_keeps_the_latest(make_proxy: Any) -> None:
    # The SDK retries when its own timeout fires; if the proxy had already staged the first
    # attempt, the trajectory must still hold the call once (the latest attempt).
    p = await make_proxy()
    sdk = _client(p, "sdk")
    body: Any = {"model": "policy", "messages": [{"role": "user", "content": "same"}]}
    await sdk.chat.completions.create(**body)
    await sdk.chat.completions.create(**body)
    first, second = p.calls("sdk")
    assert second.retry_of == first.call_id
    with open_store(p.store_url) as store:
        traj = store.trajectory("sdk", include_open=True)
    assert traj.calls == [second.call_id]
    assert traj.retries_skipped == [first.call_id]
    assert sum(traj.loss_mask) == len(second.completion_token_ids)


async def test_sdk_sees_a_422_naming_the_field(make_proxy: Any) -> None:
    p = await make_proxy()
    sdk = _client(p, "sdk", max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError, match="thinking_trace"):
        await sdk.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"thinking_trace": "t"},
        )
    (entry,) = p.failures("sdk")
    assert entry.reason == "unknown_field"
