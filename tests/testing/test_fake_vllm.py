"""The bundled fake vLLM reproduces vLLM 0.32's answers (fixtures/vllm-0.32.0) and its faults."""

from __future__ import annotations

import asyncio
import json
import re
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_proxy.testing.fake_vllm import (
    FakeToolCall,
    FakeVLLM,
    Fault,
    Turn,
    experts_for,
    read_experts,
    serve_fake,
)
from capture_proxy.testing.fake_vllm._experts import LAYERS, TOP_K
from capture_proxy.testing.fake_vllm._template import decode, encode
from tests import support

FIXTURES = support.FIXTURES / "vllm-0.32.0"
Client = TestClient[web.Request, web.Application]
Serve = Callable[..., Awaitable[tuple[FakeVLLM, Client]]]
LS_LA = FakeToolCall("bash", {"command": "ls -la"})


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def events(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, checking vLLM's framing on the way."""
    parts = raw.split(b"\n\n")
    assert parts[-1] == b"", "an SSE body ends with a blank line"
    assert all(p.startswith(b"data: ") for p in parts[:-1]), parts
    return [p[len(b"data: ") :] for p in parts[:-1]]


def fixture_chunks(name: str) -> list[Any]:
    data = events((FIXTURES / name).read_bytes())
    assert data[-1] == b"[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


def shape(obj: Any) -> Any:
    """Key names in order, nested, with value types: what must match between fake and real."""
    if isinstance(obj, dict):
        return [(k, shape(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        shapes: list[Any] = []
        for item in obj:
            if shape(item) not in shapes:
                shapes.append(shape(item))
        return ["list", *shapes]
    return type(obj).__name__


@pytest.fixture
def serve(aiohttp_client: Callable[[web.Application], Awaitable[Client]]) -> Serve:
    async def make(*turns: Turn, **kwargs: Any) -> tuple[FakeVLLM, Client]:
        fake = FakeVLLM(**kwargs)
        fake.push(*turns)
        return fake, await aiohttp_client(fake.app())

    return make


async def chat(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    result: dict[str, Any] = await resp.json()
    return result


async def chat_stream(client: Client, body: dict[str, Any]) -> list[Any]:
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    data = events(await resp.read())
    assert data[-1] == b"[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


def tool_request(**extra: Any) -> dict[str, Any]:
    """The fixture's tool-call request without the steering only the random model needed."""
    body = fixture("tool-call-request.json")
    del body["structured_outputs"], body["chat_template_kwargs"]
    return {**body, "max_tokens": 500, **extra}


def without_delta(chunk: Any) -> Any:
    return {**chunk, "choices": [{**c, "delta": {}} for c in chunk["choices"]]}


def stream_ids(chunks: list[Any]) -> list[int]:
    return [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]


# --- shapes, against the real answers ---------------------------------------------------------


def test_orjson_writes_the_bytes_vllm_sends() -> None:
    for name in ("chat-stream.sse", "tool-call-stream.sse"):
        for data in events((FIXTURES / name).read_bytes())[:-1]:
            assert orjson.dumps(orjson.loads(data)) == data


async def test_chat_response_has_the_fixture_shape(serve: Serve) -> None:
    fake, client = await serve()
    real = fixture("chat-response.json")
    got = await chat(client, fixture("chat-request.json"))
    assert shape(got) == shape(real)
    choice = got["choices"][0]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", got["id"])
    assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", got["system_fingerprint"])
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == got["usage"]["completion_tokens"] == 6
    assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] + 6
    tokens = [e["token"] for e in choice["logprobs"]["content"]]
    assert tokens == [f"token_id:{t}" for t in choice["token_ids"]]
    assert got["prompt_token_ids"] == fake.responses[0]["prompt_token_ids"]
    assert choice["token_ids"] == fake.responses[0]["completion_token_ids"]


async def test_tool_call_response_matches_the_fixture(serve: Serve) -> None:
    _, client = await serve(Turn("", tool_calls=[LS_LA]))
    real = fixture("tool-call-response.json")
    got = await chat(client, fixture("tool-call-request.json"))
    assert shape(got) == shape(real)
    message, real_message = got["choices"][0]["message"], real["choices"][0]["message"]
    assert message["tool_calls"][0]["function"] == real_message["tool_calls"][0]["function"]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", message["tool_calls"][0]["id"])
    assert (message["content"], message["reasoning"]) == (None, None)
    assert got["choices"][0]["finish_reason"] == "tool_calls"
    assert got["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    # The completion is the text vLLM generated (its logprob token strings, joined).
    real_text = "".join(e["token"] for e in real["choices"][0]["logprobs"]["content"])
    assert decode(got["choices"][0]["token_ids"]) == real_text
    assert got["choices"][0]["token_ids"][-2:] == real["choices"][0]["token_ids"][-2:] == [6, 2]


async def test_stream_has_the_fixture_chunk_sequence(serve: Serve) -> None:
    fake, client = await serve()
    real = fixture_chunks("chat-stream.sse")
    body = {**fixture("chat-request.json"), "stream_options": {"include_usage": True}}
    got = await chat_stream(client, body)
    assert len(got) == len(real) == 8  # role, 6 tokens, usage
    assert shape(got[0]) == shape(real[0])
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # Our answer opens with <think>\n (empty deltas), vLLM's random model with bare newlines.
    for g, r in zip(got[1:-2], real[1:-2], strict=True):
        assert shape(without_delta(g)) == shape(without_delta(r))
        assert len(g["choices"][0]["token_ids"]) == 1
    assert shape(got[-3]["choices"][0]["delta"]) == shape(real[-3]["choices"][0]["delta"])
    assert shape(got[-2]) == shape(real[-2])
    assert (got[-2]["choices"][0]["finish_reason"], got[-2]["choices"][0]["stop_reason"]) == (
        "length",
        None,
    )
    assert shape(got[-1]) == shape(real[-1])
    assert got[-1]["choices"] == []
    assert len({c["id"] for c in got}) == 1
    assert got[0]["prompt_token_ids"] == fake.responses[0]["prompt_token_ids"]
    assert stream_ids(got) == fake.responses[0]["completion_token_ids"]
    assert got[-1]["usage"]["completion_tokens"] == 6


async def test_streamed_tool_call_follows_the_fixture(serve: Serve) -> None:
    fake, client = await serve(Turn("", tool_calls=[LS_LA]))
    real = fixture_chunks("tool-call-stream.sse")
    body = {**fixture("tool-call-request.json"), "stream_options": {"include_usage": True}}
    got = await chat_stream(client, body)

    def tool_deltas(chunks: list[Any]) -> list[Any]:
        return [c["choices"][0]["delta"] for c in chunks[1:-1] if c["choices"][0]["delta"]]

    real_deltas, got_deltas = tool_deltas(real), tool_deltas(got)
    assert shape(got_deltas[0]) == shape(real_deltas[0])  # id, type, index, function.name
    assert got_deltas[0]["tool_calls"][0]["function"] == {"name": "bash"}
    assert {json.dumps(shape(d)) for d in got_deltas[1:]} == {
        json.dumps(shape(d)) for d in real_deltas[1:]
    }

    def arguments(deltas: list[Any]) -> str:
        return "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas)

    assert arguments(got_deltas) == arguments(real_deltas) == '{"command": "ls -la"}'
    finish = got[-2]["choices"][0]
    assert (finish["delta"], finish["finish_reason"]) == ({}, "tool_calls")
    assert shape(got[-2]) == shape(real[-2])
    # Every token id arrives, as in 0.32 (48 of 48 in the fixture).
    assert stream_ids(got) == fake.responses[0]["completion_token_ids"]
    assert len(stream_ids(got)) == got[-1]["usage"]["completion_tokens"]


async def test_stream_without_usage_or_ids_skips_empty_deltas(serve: Serve) -> None:
    fake, client = await serve(Turn("hi", reasoning="think"), Turn("hi", reasoning="think"))
    got = await chat_stream(client, {"messages": [{"role": "user", "content": "x"}]})
    assert got[0]["prompt_token_ids"] is None
    assert got[0]["prompt_text"] is None
    deltas = [c["choices"][0]["delta"] for c in got[1:]]
    # <think>, \n and the markers around the answer have no delta and are not sent.
    assert deltas == [{"reasoning": c} for c in "think"] + [{"content": "h"}, {"content": "i"}, {}]
    last = got[-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["system_fingerprint"].startswith("vllm-0.32.0-")  # no usage chunk follows
    assert all(c["choices"][0]["token_ids"] is None for c in got[1:])
    # Asking for token ids sends every token, the empty deltas as {}.
    with_ids = await chat_stream(
        client, {"messages": [{"role": "user", "content": "x"}], "return_token_ids": True}
    )
    assert stream_ids(with_ids) == fake.responses[1]["completion_token_ids"]
    assert [c["choices"][0]["delta"] for c in with_ids[1:3]] == [{}, {}]  # <think>, \n


# --- errors --------------------------------------------------------------------------------


async def test_max_tokens_over_context_is_vllms_400(serve: Serve) -> None:
    _, client = await serve()
    body = {**fixture("chat-request.json"), "max_tokens": 9000}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    assert await resp.json() == fixture("error-max-tokens.json")


async def test_unknown_model_is_vllms_404(serve: Serve) -> None:
    fake, client = await serve()
    resp = await client.post(
        "/v1/chat/completions", json={**fixture("chat-request.json"), "model": "nope"}
    )
    assert resp.status == 404
    assert await resp.json() == fixture("error-model.json")
    assert fake.responses == []


async def test_prompt_plus_max_tokens_over_context_is_a_400(serve: Serve) -> None:
    fake, client = await serve(Turn("unused"), max_model_len=300)
    body = {"messages": [{"role": "user", "content": "x" * 280}], "max_tokens": 100}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "BadRequestError",
        "input_tokens",
        400,
    )
    assert error["message"].startswith(
        "This model's maximum context length is 300 tokens. However, you requested 100 output "
        "tokens and your prompt contains at least 201 input tokens"
    )
    # A refused request does not use up the scripted answer.
    assert (await chat(client, {"messages": [{"role": "user", "content": "y"}]}))["choices"][0][
        "message"
    ]["content"] == "unused"
    assert len(fake.requests) == 2


async def test_bad_bodies_are_400s(serve: Serve) -> None:
    _, client = await serve()
    for data in (b"{not json", b"[1]", b'{"messages": "hi"}', b'{"messages": [], "max_tokens": 0}'):
        resp = await client.post("/v1/chat/completions", data=data)
        assert resp.status == 400, data
        error = (await resp.json())["error"]
        assert list(error) == ["message", "type", "param", "code"]
        assert error["code"] == 400


async def test_api_key_guards_v1_routes_only(serve: Serve) -> None:
    fake, client = await serve(api_key="sekret")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekret"}):
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 401
        assert await resp.json() == {"error": "Unauthorized"}
    assert fake.requests == []
    assert (await client.get("/v1/models")).status == 401
    ok = await client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sekret"}
    )
    assert ok.status == 200
    assert fake.request_headers[0]["Authorization"] == "Bearer sekret"
    for path in ("/health", "/version"):
        assert (await client.get(path)).status == 200
    assert (await client.post("/tokenize", json={"prompt": "a"})).status == 200


async def test_unknown_top_level_keys_are_ignored(serve: Serve) -> None:
    _, client = await serve()
    body = {"messages": [{"role": "user", "content": "hi"}], "thinking_trace": 1, "foo": {"x": 1}}
    assert (await chat(client, body))["choices"][0]["finish_reason"] == "stop"


# --- the other routes --------------------------------------------------------------------


async def test_models_version_health(serve: Serve) -> None:
    _, client = await serve(model="policy")
    models = await (await client.get("/v1/models")).json()
    assert shape(models) == shape(fixture("models.json"))
    card = models["data"][0]
    assert (card["id"], card["root"], card["max_model_len"]) == ("policy", "policy", 8192)
    assert re.fullmatch(r"modelperm-[0-9a-f]{16}", card["permission"][0]["id"])
    version = await client.get("/version")
    assert await version.read() == (FIXTURES / "version.json").read_bytes().strip()
    health = await client.get("/health")
    assert (health.status, await health.read()) == (200, b"")


async def test_tokenize_agrees_with_the_chat_prompt(serve: Serve) -> None:
    fake, client = await serve()
    request = fixture("chat-request.json")
    got = await chat(client, request)
    tok = await client.post(
        "/tokenize",
        json={"model": "policy", "messages": request["messages"], "tools": request["tools"]},
    )
    body = await tok.json()
    assert shape(body) == shape(fixture("tokenize.json"))
    assert (
        body["tokens"]
        == got["prompt_token_ids"]
        == fake.tokenize_chat(request["messages"], request["tools"])
    )
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 8192
    # Special tokens have the ids of the real tokenizer behind the fixtures.
    short = [{"role": "user", "content": "hi"}]
    assert fake.tokenize_chat(short) == [
        1,
        *encode("user\n"),
        *encode("hi"),
        2,
        *encode("\n"),
        1,
        *encode("assistant\n"),
    ]
    strs = await (
        await client.post("/tokenize", json={"prompt": "a<think>", "return_token_strs": True})
    ).json()
    assert (strs["tokens"], strs["token_strs"]) == ([113, 3], ["a", "<think>"])


async def test_image_parts_render_as_one_pad_token(serve: Serve) -> None:
    fake, client = await serve()
    url = "data:image/png;base64,iVBORw0KGgo="
    parts = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]
    got = await chat(
        client, {"messages": [{"role": "user", "content": parts}], "return_token_ids": True}
    )
    assert got["prompt_token_ids"][:10] == [1, *encode("user\n"), *encode("see"), 9]
    assert fake.requests[0]["messages"][0]["content"] == parts


async def test_detokenize_round_trips(serve: Serve) -> None:
    _, client = await serve()
    text = "<|im_start|>user\nhé 世界<|im_end|>"
    resp = await client.post("/detokenize", json={"tokens": encode(text)})
    assert await resp.json() == {"prompt": text}
    bad = await client.post("/detokenize", json={"tokens": [12]})
    assert bad.status == 400
    assert "not in the vocabulary" in (await bad.json())["error"]["message"]


# --- generation ---------------------------------------------------------------------------


async def test_max_tokens_cuts_with_length(serve: Serve) -> None:
    _, client = await serve(Turn("abcdefghij"), Turn("abcdefghij"))
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100}
    got = await chat(client, {**body, "max_completion_tokens": 4, "return_token_ids": True})
    assert got["choices"][0]["message"]["content"] == "abcd"
    assert got["choices"][0]["finish_reason"] == "length"
    full = await chat(client, {**body, "return_token_ids": True})
    assert full["choices"][0]["finish_reason"] == "stop"
    assert full["choices"][0]["token_ids"] == [*encode("abcdefghij"), 2]


async def test_default_answer_is_deterministic_and_echoes(serve: Serve) -> None:
    fake, client = await serve(seed=7)
    body = {"messages": [{"role": "user", "content": "list my files please"}], "logprobs": True}
    a, b = await chat(client, body), await chat(client, body)
    assert a["choices"][0]["message"]["content"] == "You said: list my files please"
    assert a["choices"][0]["message"]["reasoning"]
    assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
    assert fake.responses[0]["completion_token_ids"] == fake.responses[1]["completion_token_ids"]
    assert a["id"] != b["id"]


async def test_script_answers_when_the_queue_is_empty(serve: Serve) -> None:
    seen: list[int] = []

    def script(request: dict[str, Any]) -> Turn:
        seen.append(len(request["messages"]))
        return Turn(f"scripted {len(seen)}")

    _, client = await serve(Turn("queued"), script=script)
    body = {"messages": [{"role": "user", "content": "x"}]}
    contents = [(await chat(client, body))["choices"][0]["message"]["content"] for _ in range(3)]
    assert contents == ["queued", "scripted 1", "scripted 2"]
    assert seen == [1, 1]


async def test_logprobs_are_float32_and_recorded_bit_for_bit(serve: Serve) -> None:
    fake, client = await serve(Turn("héllo", reasoning="hm"))
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
    }
    got = await chat(client, body)
    entries = got["choices"][0]["logprobs"]["content"]
    values = [e["logprob"] for e in entries]
    assert values == fake.responses[0]["logprobs"]
    assert all(v < 0 and struct.unpack("<f", struct.pack("<f", v))[0] == v for v in values)
    assert all(len(e["top_logprobs"]) == 3 for e in entries)
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries)
    assert all(list(e["top_logprobs"][0]) == ["token", "logprob", "bytes"] for e in entries)
    ids = got["choices"][0]["token_ids"]
    assert b"".join(bytes(e["bytes"]) for e in entries) == decode(ids).encode()
    as_ids = await chat(client, {**body, "return_tokens_as_token_ids": True})
    top = as_ids["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]
    # vLLM's quirk: a top entry's bytes are those of its "token_id:N" string.
    assert bytes(top["bytes"]).decode() == top["token"] == f"token_id:{ids[0]}"


async def test_multibyte_text_streams_in_whole_characters(serve: Serve) -> None:
    _, client = await serve(Turn("héllo 世界", reasoning="ü"))
    got = await chat_stream(
        client, {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    )
    deltas = [c["choices"][0]["delta"] for c in got[1:]]
    assert "".join(d.get("content", "") for d in deltas) == "héllo 世界"
    assert "".join(d.get("reasoning", "") for d in deltas) == "ü"
    assert not any("\ufffd" in (d.get("content") or "") for d in deltas)
    # With logprobs every token has a chunk, even the bytes that finish no character.
    assert len(got) - 1 == len(encode("<think>\nü\n</think>\n\nhéllo 世界<|im_end|>"))


async def test_enable_thinking_false_suppresses_reasoning(serve: Serve) -> None:
    _, client = await serve(Turn("ok", reasoning="hidden"))
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    got = await chat(client, body)
    assert got["choices"][0]["message"]["reasoning"] is None
    assert got["usage"]["completion_tokens"] == 3
    assert got["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


async def test_tool_choice_none_leaves_tool_text_in_content(serve: Serve) -> None:
    _, client = await serve(Turn("", tool_calls=[LS_LA]))
    got = await chat(client, tool_request(tool_choice="none"))
    message = got["choices"][0]
    assert "tool_calls" not in message["message"]
    assert message["message"]["content"].startswith("<tool_call>\n")
    assert message["finish_reason"] == "stop"


async def test_tool_call_cut_short_is_content(serve: Serve) -> None:
    _, client = await serve(Turn("see", tool_calls=[LS_LA]))
    got = await chat(client, tool_request(max_tokens=10))
    message = got["choices"][0]["message"]
    assert "tool_calls" not in message
    whole = 'see\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    # The hermes parser cannot parse half a call: all the text is content.
    assert message["content"] == decode(encode(whole)[:10])
    assert got["choices"][0]["finish_reason"] == "length"


async def test_return_prompt_text(serve: Serve) -> None:
    _, client = await serve()
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "return_prompt_text": True,
        "return_token_ids": True,
    }
    got = await chat(client, body)
    assert got["prompt_text"] == decode(got["prompt_token_ids"])


# --- include_reasoning: false (a hazard, docs/upstream-facts.md) ---------------------------


async def test_include_reasoning_false_hides_ids_and_logprobs(serve: Serve) -> None:
    fake, client = await serve(
        Turn("answer", reasoning="secret"), Turn("answer", reasoning="secret")
    )
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "include_reasoning": False,
        "return_token_ids": True,
        "logprobs": True,
    }
    got = await chat(client, body)
    choice = got["choices"][0]
    assert choice["message"]["reasoning"] is None
    assert choice["message"]["content"] == "answer"
    assert (choice["logprobs"], choice["token_ids"]) == (None, None)
    assert got["prompt_token_ids"] == fake.responses[0]["prompt_token_ids"]
    chunks = await chat_stream(client, body)
    assert all(
        c["choices"][0]["token_ids"] is None and c["choices"][0]["logprobs"] is None
        for c in chunks[1:]
    )
    assert not any("reasoning" in c["choices"][0]["delta"] for c in chunks[1:])
    assert len(chunks) - 1 < len(fake.responses[1]["completion_token_ids"])


# --- replay: prefix extension and drift ------------------------------------------------------


def replay(
    request: dict[str, Any], message: dict[str, Any], *, key: str, compact: bool
) -> dict[str, Any]:
    """The next request a client sends after running the answer's tool calls."""
    calls = message.get("tool_calls") or []
    assistant: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
    if message.get("reasoning"):
        assistant[key] = message["reasoning"]
    if calls:
        assistant["tool_calls"] = [
            {
                **c,
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(
                        json.loads(c["function"]["arguments"]), separators=(",", ":")
                    )
                    if compact
                    else c["function"]["arguments"],
                },
            }
            for c in calls
        ]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "a.txt\n"} for c in calls]
    follow = results or [{"role": "user", "content": "and then?"}]
    return {**request, "messages": [*request["messages"], assistant, *follow]}


def message_from_stream(chunks: list[Any]) -> dict[str, Any]:
    """The message an OpenAI client accumulates from the deltas."""
    message: dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning"] += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or []:
                if "id" in tc:
                    message["tool_calls"].append(
                        {
                            "id": tc["id"],
                            "type": "function",
                            "function": {**tc["function"], "arguments": ""},
                        }
                    )
                message["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"].get(
                    "arguments", ""
                )
    return message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
async def test_unchanged_replay_extends_prompt_and_completion(
    serve: Serve, stream: bool, key: str
) -> None:
    turns = [
        Turn(
            "Let me look.",
            reasoning="List first.",
            tool_calls=[LS_LA, FakeToolCall("read", {"path": "é.txt"})],
        ),
        Turn(
            "",
            reasoning="Now read it.",
            tool_calls=[FakeToolCall("bash", {"command": "cat a.txt"})],
        ),
        Turn("Done: a.txt"),
    ]
    fake, client = await serve(*turns)
    request = tool_request(return_token_ids=True, stream_options={"include_usage": True})
    for i in range(3):
        if stream:
            message = message_from_stream(await chat_stream(client, request))
        else:
            message = (await chat(client, request))["choices"][0]["message"]
        record = fake.responses[i]
        if i:
            prev = fake.responses[i - 1]
            full = prev["prompt_token_ids"] + prev["completion_token_ids"]
            assert record["prompt_token_ids"][: len(full)] == full
        request = replay(request, message, key=key, compact=False)


async def test_compact_tool_arguments_drift(serve: Serve) -> None:
    fake, client = await serve(Turn("", tool_calls=[LS_LA]), Turn("ok"))
    request = tool_request(return_token_ids=True)
    message = (await chat(client, request))["choices"][0]["message"]
    await chat(client, replay(request, message, key="reasoning_content", compact=True))
    first, second = fake.responses
    full = first["prompt_token_ids"] + first["completion_token_ids"]
    diverge = next(
        i for i, (a, b) in enumerate(zip(full, second["prompt_token_ids"], strict=False)) if a != b
    )
    assert len(first["prompt_token_ids"]) < diverge < len(full)
    assert decode(full[:diverge]).endswith('{"command":')  # the space the client dropped


async def test_reparse_tool_arguments_renders_like_real_vllm(serve: Serve) -> None:
    fake, client = await serve(
        Turn("", tool_calls=[LS_LA]), Turn("ok"), reparse_tool_arguments=True
    )
    request = tool_request()
    message = (await chat(client, request))["choices"][0]["message"]
    await chat(client, replay(request, message, key="reasoning_content", compact=True))
    first, second = fake.responses
    full = first["prompt_token_ids"] + first["completion_token_ids"]
    assert second["prompt_token_ids"][: len(full)] == full


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(content=st.text(max_size=30), reasoning=st.text(max_size=30), arg=st.text(max_size=12))
async def test_replay_extends_for_any_text(content: str, reasoning: str, arg: str) -> None:
    fake, runner, base = await serve_fake()
    try:
        fake.push(
            Turn(content, reasoning=reasoning, tool_calls=[FakeToolCall("f", {"a": arg})]),
            Turn("end"),
        )
        request = tool_request(return_token_ids=True)
        async with aiohttp.ClientSession() as session:
            async with session.post(base + "/v1/chat/completions", json=request) as resp:
                message = (await resp.json())["choices"][0]["message"]
            async with session.post(
                base + "/v1/chat/completions",
                json=replay(request, message, key="reasoning", compact=False),
            ) as resp:
                assert resp.status == 200
        first, second = fake.responses
        full = first["prompt_token_ids"] + first["completion_token_ids"]
        assert second["prompt_token_ids"][: len(full)] == full
    finally:
        await runner.cleanup()


async def test_reasoning_input_depends_on_version(serve: Serve) -> None:
    history = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y", "reasoning_content": "R1"},
        {"role": "assistant", "content": "z", "reasoning": "R2"},
    ]
    new = FakeVLLM(version="0.32.0").tokenize_chat(history)
    old = FakeVLLM(version="0.20.1").tokenize_chat(history)
    assert "<think>\nR1\n</think>" in decode(new)
    assert "<think>\nR2\n</think>" in decode(new)
    assert "R1" not in decode(old)
    assert "<think>\nR2\n</think>" in decode(old)
    _, client = await serve(Turn("a", reasoning="b"), version="0.10.2")
    message = (await chat(client, {"messages": history}))["choices"][0]["message"]
    assert message["reasoning_content"] == "b"
    assert "reasoning" not in message


# --- faults ------------------------------------------------------------------------------


async def test_http_error_fault(serve: Serve) -> None:
    fake, client = await serve(
        Turn(fault=Fault.http_error(503)), Turn(fault=Fault.http_error(429, {"x": 1}))
    )
    body = {"messages": [{"role": "user", "content": "x"}]}
    first = await client.post("/v1/chat/completions", json=body)
    assert first.status == 503
    assert await first.json() == {
        "error": {
            "message": "Service Unavailable",
            "type": "Service Unavailable",
            "param": None,
            "code": 503,
        }
    }
    second = await client.post("/v1/chat/completions", json=body)
    assert (second.status, await second.json()) == (429, {"x": 1})
    assert fake.responses == []


async def test_delay_first_byte(serve: Serve) -> None:
    _, client = await serve(Turn("late", fault=Fault.delay_first_byte(0.2)))
    start = time.monotonic()
    got = await chat(client, {"messages": [{"role": "user", "content": "x"}]})
    assert time.monotonic() - start >= 0.2
    assert got["choices"][0]["message"]["content"] == "late"


async def test_reset_after_closes_the_connection_mid_stream(serve: Serve) -> None:
    _, client = await serve(
        Turn("abcdefgh", fault=Fault.reset_after(3)), Turn("x", fault=Fault.reset_after(0))
    )
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    received: list[bytes] = []

    async def read_all() -> None:
        async for chunk in resp.content.iter_any():
            received.append(chunk)

    with pytest.raises(aiohttp.ClientPayloadError):
        await read_all()
    received_bytes = b"".join(received)
    assert received_bytes.count(b"data: ") == 3
    assert b"[DONE]" not in received_bytes
    with pytest.raises(aiohttp.ClientConnectionError):
        await client.post("/v1/chat/completions", json={**body, "stream": False})


async def test_malformed_sse_fault(serve: Serve) -> None:
    _, client = await serve(
        Turn("abc", fault=Fault.malformed_sse(after=2)),
        Turn("abc", fault=Fault.malformed_sse(after=0)),
    )
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    data = events(await (await client.post("/v1/chat/completions", json=body)).read())
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(data[2])
    assert data[-1] == b"[DONE]"
    assert len(data) == 1 + 2 + 3 + 1
    bad = await client.post("/v1/chat/completions", json={**body, "stream": False})
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(await bad.read())


async def test_truncate_after_ends_cleanly_without_finish(serve: Serve) -> None:
    _, client = await serve(Turn("abcdefgh", fault=Fault.truncate_after(4)))
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    data = events(await (await client.post("/v1/chat/completions", json=body)).read())
    assert len(data) == 4
    assert b"[DONE]" not in data
    assert all(orjson.loads(d)["choices"][0]["finish_reason"] is None for d in data)


async def test_drop_token_ids_fault(serve: Serve) -> None:
    turns = [Turn("abcdefgh", fault=Fault.drop_token_ids()) for _ in range(2)]
    turns += [Turn("abcdefgh", fault=Fault.drop_token_ids(every=3)) for _ in range(2)]
    fake, client = await serve(*turns)
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "return_token_ids": True,
        "logprobs": True,
    }
    got = await chat(client, body)
    assert got["prompt_token_ids"] is None
    assert got["choices"][0]["token_ids"] is None
    chunks = await chat_stream(client, body)
    assert chunks[0]["prompt_token_ids"] is None
    assert stream_ids(chunks) == []
    some = await chat(client, body)
    assert len(some["choices"][0]["token_ids"]) == 6 < some["usage"]["completion_tokens"] == 9
    assert len(some["choices"][0]["logprobs"]["content"]) == 6
    stream_opts = {**body, "stream_options": {"include_usage": True}}
    chunks = await chat_stream(client, stream_opts)
    # Tokens 3 and 6 lose their chunks; the finish chunk (token 9) always arrives.
    assert len(stream_ids(chunks)) == 7 < chunks[-1]["usage"]["completion_tokens"] == 9
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert len(fake.responses[3]["completion_token_ids"]) == 9


async def test_usage_mismatch_fault(serve: Serve) -> None:
    _, client = await serve(Turn("abc", fault=Fault.usage_mismatch()))
    got = await chat(
        client, {"messages": [{"role": "user", "content": "x"}], "return_token_ids": True}
    )
    assert got["usage"]["completion_tokens"] == len(got["choices"][0]["token_ids"]) + 1


async def test_error_event_fault(serve: Serve) -> None:
    _, client = await serve(
        Turn("abcdef", fault=Fault.error_event(after=2)), Turn("x", fault=Fault.error_event())
    )
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    data = events(await (await client.post("/v1/chat/completions", json=body)).read())
    assert len(data) == 4
    assert data[-1] == b"[DONE]"
    assert (
        data[2]
        == json.dumps(
            {
                "error": {
                    "message": "engine failure (injected)",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        ).encode()
    )
    resp = await client.post("/v1/chat/completions", json={**body, "stream": False})
    assert resp.status == 500
    assert (await resp.json())["error"]["type"] == "InternalServerError"


async def wait_for(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5.0
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_hang_counts_an_abort_when_the_client_leaves(serve: Serve) -> None:
    fake, client = await serve(Turn(fault=Fault.hang()))
    with pytest.raises(asyncio.TimeoutError):
        await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
            timeout=aiohttp.ClientTimeout(total=0.2),
        )
    await wait_for(lambda: fake.aborted == 1)


async def test_a_hanging_fake_does_not_hold_teardown() -> None:
    fake, runner, base = await serve_fake()
    fake.push(Turn(fault=Fault.hang()))
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(
            session.post(base + "/v1/chat/completions", json={"messages": []})
        )
        await wait_for(lambda: len(fake.requests) == 1)
        start = time.monotonic()
        await runner.cleanup()
        assert time.monotonic() - start < 10  # aiohttp's default would wait 60 s
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await call
    assert fake.aborted == 1


@pytest.mark.parametrize("cancellation", [True, False])
async def test_client_leaving_mid_stream_aborts(serve: Serve, cancellation: bool) -> None:
    # The test server cancels handlers on disconnect; serve_fake's runner does not.
    if cancellation:
        fake, client = await serve(Turn("x" * 200), chunk_delay=0.02)
        url, session = "/v1/chat/completions", client.session
        target: Any = client
    else:
        fake, runner, base = await serve_fake(chunk_delay=0.02)
        fake.push(Turn("x" * 200))
        session = aiohttp.ClientSession()
        url, target = base + "/v1/chat/completions", session
    try:
        resp = await target.post(
            url, json={"messages": [{"role": "user", "content": "x"}], "stream": True}
        )
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()
        await wait_for(lambda: fake.aborted == 1)
        await asyncio.sleep(0.05)
        assert fake.aborted == 1  # counted once
        assert fake.responses[0]["completion_token_ids"][-1] == 2  # the whole answer was planned
    finally:
        if not cancellation:
            await session.close()
            await runner.cleanup()


def test_module_runs_standalone() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "capture_proxy.fake_vllm", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "--port" in out.stdout
    assert "--model" in out.stdout


# -- routed experts (--enable-return-routed-experts) ------------------------------------------


async def test_routed_experts_cover_prompt_and_output_from_the_start_asked(serve: Serve) -> None:
    _, client = await serve(routed_experts=True)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    full = await chat(client, {**body, "return_token_ids": True})
    ids = full["prompt_token_ids"] + full["choices"][0]["token_ids"]
    shape, values = read_experts(full["choices"][0]["routed_experts"])
    assert shape == (len(ids), LAYERS, TOP_K)
    assert values == experts_for(ids)
    # From a start on: only the positions after it, the same values there.
    start = len(full["prompt_token_ids"]) - 3
    delta = await chat(client, {**body, "routed_experts_prompt_start": start})
    shape, values = read_experts(delta["choices"][0]["routed_experts"])
    assert shape == (len(ids) - start, LAYERS, TOP_K)
    assert values == experts_for(ids, start)
    # Streamed: on the finish chunk, the same string.
    chunks = await chat_stream(client, {**body, "routed_experts_prompt_start": start})
    carried = [
        c["choices"][0]["routed_experts"]
        for c in chunks
        if "routed_experts" in c.get("choices", [{}])[0]
    ]
    assert carried == [delta["choices"][0]["routed_experts"]]
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


async def test_routed_experts_are_null_unless_the_server_returns_them(serve: Serve) -> None:
    _, client = await serve()
    got = await chat(client, {"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
    assert got["choices"][0]["routed_experts"] is None


USER_HI = {"role": "user", "content": "hi"}


# -- scale-out render and dev-mode weight routes ------------------------------------------------


async def test_the_render_route_needs_scale_out(serve: Serve) -> None:
    _, client = await serve()
    resp = await client.post("/v1/chat/completions/render", json={"messages": [USER_HI]})
    assert resp.status == 403
    assert await resp.json() == fixture("token-in/disabled-render.json")["body"]


@pytest.mark.parametrize("name", ["chat", "tools", "continue", "max-tokens-16"])
async def test_render_answer_has_the_fixture_shape(serve: Serve, name: str) -> None:
    """Keys, their order and value types as the real render's (not the ids: the fake's
    tokenizer is another); `sampling_params` lists what the real one lists for that request."""
    _, client = await serve(scale_out=True)
    resp = await client.post(
        "/v1/chat/completions/render", json=fixture(f"token-in/render-{name}-request.json")
    )
    assert resp.status == 200, await resp.text()
    got = await resp.json()
    real = fixture(f"token-in/render-{name}-response.json")
    # vLLM adds a Cohere template setting to every render; no template of the fake reads it.
    del real["reasoning_parser_kwargs"]["chat_template_kwargs"]["cohere_format"]
    assert shape(got) == shape(real)
    assert got["sampling_params"] == real["sampling_params"]
    assert got["reasoning_parser_kwargs"] == real["reasoning_parser_kwargs"]
    assert got["reasoning_ended"] == real["reasoning_ended"]


async def test_the_render_route_resolves_sampling_over_the_generation_config(
    serve: Serve,
) -> None:
    fake, client = await serve(scale_out=True, generation_config={"temperature": 0.6, "top_k": 20})
    body = {"model": "policy", "messages": [USER_HI], "top_p": 0.9, "max_tokens": 7}
    resp = await client.post("/v1/chat/completions/render", json=body)
    assert resp.status == 200
    answer = await resp.json()
    assert list(answer) == list(fixture("token-in/render-chat-response.json"))
    assert answer["token_ids"] == fake.tokenize_chat([USER_HI])
    params = answer["sampling_params"]
    assert (params["temperature"], params["top_k"], params["top_p"]) == (0.6, 20, 0.9)
    assert (params["min_p"], params["repetition_penalty"], params["max_tokens"]) == (0.0, 1.0, 7)


async def test_weight_routes_exist_only_in_dev_mode(serve: Serve) -> None:
    _, plain = await serve()
    resp = await plain.get("/weight_info")
    assert resp.status == 404
    assert await resp.json() == fixture("token-in/disabled-weight-info.json")["body"]
    _, dev = await serve(dev_mode=True)
    assert await (await dev.get("/weight_info")).json() == {"weight_version": "default"}
    resp = await dev.post("/update_weight_version", json={"new_version": "step-3"})
    assert resp.status == 200
    assert await resp.json() == {"success": True, "new_version": "step-3"}
    assert shape(await resp.json()) == shape(
        fixture("token-in/update-weight-version-response.json")
    )
    assert await (await dev.get("/weight_info")).json() == {"weight_version": "step-3"}
    assert (await dev.post("/update_weight_version", json={"new_version": 3})).status == 400


def test_drop_past_reasoning_makes_the_template_not_append_only() -> None:
    from capture_proxy.testing.fake_vllm._template import render_chat

    turn1 = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a", "reasoning": "think 1"},
    ]
    tool_reply = [*turn1, {"role": "tool", "tool_call_id": "c", "content": "r"}]
    new_user = [*turn1, {"role": "user", "content": "next"}]
    closed = render_chat(turn1, add_generation_prompt=False, drop_past_reasoning=True)
    # A tool result keeps the turn after the last user message: the reasoning stays.
    assert render_chat(tool_reply, drop_past_reasoning=True).startswith(closed)
    # A new user message drops the earlier reasoning: the history re-renders differently.
    again = render_chat(new_user, drop_past_reasoning=True)
    assert "think 1" in closed
    assert "think 1" not in again
    assert not again.startswith(closed)
    # Without the option the template is append-only here.
    assert render_chat(new_user).startswith(render_chat(turn1, add_generation_prompt=False))
