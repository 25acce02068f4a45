"""The fake vLLM's token-in routes (generate, derender, render's options) held to vLLM 0.32's
captured answers in tests/fixtures/vllm-0.32.0/token-in/."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from capture_proxy.testing.fake_vllm import FakeToolCall, Turn
from tests.testing.test_fake_vllm import (
    FIXTURES,
    Client,
    Serve,
    events,
    fixture,
    serve,
    shape,
)

__all__ = ["serve"]

GENERATE = "/inference/v1/generate"
DERENDER = "/v1/chat/completions/derender"
RENDER = "/v1/chat/completions/render"
LS = FakeToolCall("bash", {"command": "ls -la"})


async def post(client: Client, path: str, body: dict[str, Any], status: int = 200) -> Any:
    resp = await client.post(path, json=body)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def rendered(client: Client, name: str) -> dict[str, Any]:
    answer: dict[str, Any] = await post(
        client, RENDER, fixture(f"token-in/render-{name}-request.json")
    )
    return answer


async def stream_events(client: Client, body: dict[str, Any]) -> list[Any]:
    resp = await client.post(GENERATE, json=body)
    assert resp.status == 200
    data = events(await resp.read())
    assert data[-1] == b"[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


def real_stream(name: str) -> list[Any]:
    data = events((FIXTURES / f"token-in/generate-{name}-stream.sse").read_bytes())
    return [orjson.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path", [GENERATE, DERENDER])
async def test_generate_and_derender_need_scale_out(serve: Serve, path: str) -> None:
    _, client = await serve()
    name = "generate" if path == GENERATE else "derender"
    got = await post(client, path, {"token_ids": [1]}, status=403)
    assert got == fixture(f"token-in/disabled-{name}.json")["body"]


@pytest.mark.parametrize("name", ["chat", "tools"])
async def test_generate_answer_has_the_fixture_shape(serve: Serve, name: str) -> None:
    _, client = await serve(Turn("ok", reasoning="r", tool_calls=[LS]), scale_out=True)
    got = await post(client, GENERATE, await rendered(client, name))
    real = fixture(f"token-in/generate-{name}-response.json")
    assert shape(got) == shape(real)
    assert got["request_id"].startswith("generate-tokens-chatcmpl-")
    assert got["prompt_token_ids"] is None


async def test_a_stop_answer_ends_with_the_end_of_turn_id_and_a_cut_one_does_not(
    serve: Serve,
) -> None:
    _, client = await serve(Turn("hello"), Turn("hello"), scale_out=True)
    body = await rendered(client, "chat")
    body["sampling_params"]["max_tokens"] = 100
    done = (await post(client, GENERATE, body))["choices"][0]
    assert (done["finish_reason"], done["token_ids"][-1]) == ("stop", 2)
    assert done["weight_versions"] == [
        {"version": "default", "start": 0, "end": len(done["token_ids"])}
    ]
    body["sampling_params"]["max_tokens"] = 3
    cut = (await post(client, GENERATE, body))["choices"][0]
    assert (cut["finish_reason"], cut["token_ids"]) == ("length", done["token_ids"][:3])


@pytest.mark.parametrize("name", ["chat", "tools"])
async def test_streamed_generate_follows_the_fixture_event_sequence(
    serve: Serve, name: str
) -> None:
    fake, client = await serve(Turn("ok", reasoning="r", tool_calls=[LS]), scale_out=True)
    body = {
        **await rendered(client, name),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body["sampling_params"]["max_tokens"] = 200
    got = await stream_events(client, body)
    real = real_stream(name)
    assert [shape(e) for e in (got[0], got[-2], got[-1])] == [
        shape(e) for e in (real[0], real[-2], real[-1])
    ]
    tokens = got[:-1]
    assert all(e["choices"][0]["weight_versions"] is None for e in tokens[:-1])
    ids = [t for e in tokens for t in e["choices"][0]["token_ids"]]
    assert ids == fake.responses[0]["completion_token_ids"]
    assert tokens[-1]["choices"][0]["weight_versions"] == [
        {"version": "default", "start": 0, "end": len(ids)}
    ]
    assert got[-1]["choices"] == []
    assert got[-1]["usage"]["completion_tokens"] == len(ids)


async def test_a_weight_update_during_a_streamed_generate_splits_the_spans(serve: Serve) -> None:
    fake, client = await serve(Turn("x" * 30), scale_out=True, dev_mode=True, chunk_delay=0.01)
    body = {**await rendered(client, "chat"), "stream": True}
    body["sampling_params"]["max_tokens"] = 100
    resp = await client.post(GENERATE, json=body)
    await resp.content.readuntil(b"\n\n")
    await post(client, "/update_weight_version", {"new_version": "step-2"})
    data = events(await resp.read())
    last = orjson.loads(data[-2])["choices"][0]
    spans = last["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "step-2"]
    assert spans[0]["start"] == 0
    assert spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == len(fake.responses[0]["completion_token_ids"])


async def unary_derender(client: Client, name: str, generated: Any) -> Any:
    real = fixture(f"token-in/derender-{name}-request.json")
    body = {
        "generate_response": generated,
        "prompt_token_ids": [1, 2],
        "chat_request": real["chat_request"],
    }
    return await post(client, DERENDER, body)


@pytest.mark.parametrize("name", ["chat", "tools"])
async def test_derender_answer_has_the_fixture_shape(serve: Serve, name: str) -> None:
    turn = Turn("", tool_calls=[LS]) if name == "tools" else Turn("ok", reasoning="r" * 20)
    _, client = await serve(turn, scale_out=True)
    body = await rendered(client, name)
    # As the real chat answer: cut by length inside the reasoning.
    body["sampling_params"]["max_tokens"] = 200 if name == "tools" else 6
    generated = await post(client, GENERATE, body)
    got = await unary_derender(client, name, generated)
    real = fixture(f"token-in/derender-{name}-response.json")
    assert shape(got) == shape(real)
    assert got["id"] == generated["request_id"]
    message = got["choices"][0]["message"]
    if name == "tools":
        (call,) = message["tool_calls"]
        assert re.fullmatch("[0-9a-f]{16}", call["id"])
        assert call["function"] == {"name": "bash", "arguments": '{"command": "ls -la"}'}
        assert got["choices"][0]["finish_reason"] == "stop"
    else:
        assert (message["content"], message["reasoning"]) == (None, "r" * 4)
        assert got["choices"][0]["finish_reason"] == "length"


async def derender_stream(
    client: Client, chunks: list[Any], chat_request: Any, prompt: list[int]
) -> list[Any]:
    state = None
    out = []
    for chunk in chunks:
        body = {
            "stream": True,
            "generate_chunk": chunk,
            "stream_state": state,
            "prompt_token_ids": prompt,
            "chat_request": chat_request,
        }
        answer = await post(client, DERENDER, body)
        state = answer["stream_state"]
        out.append(answer)
    return out


def keys(obj: Any) -> Any:
    """Key names in order, nested, without the leaves' types."""
    if isinstance(obj, dict):
        return [(k, keys(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return ["list", *{repr(keys(i)): keys(i) for i in obj}.values()]
    return None


def joined(answers: list[Any]) -> dict[str, Any]:
    content, reasoning = "", ""
    calls: dict[int, dict[str, Any]] = {}
    for a in answers:
        for choice in a["chunk"]["choices"]:
            d = choice["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning") or ""
            for c in d.get("tool_calls") or []:
                entry = calls.setdefault(c["index"], {"name": None, "arguments": ""})
                entry["name"] = entry["name"] or c["function"]["name"]
                entry["arguments"] += c["function"]["arguments"] or ""
    return {"content": content, "reasoning": reasoning, "calls": list(calls.values())}


@pytest.mark.parametrize("name", ["chat", "tools"])
async def test_streamed_derender_follows_the_fixture(serve: Serve, name: str) -> None:
    turn = Turn("ok", reasoning="hm", tool_calls=[LS]) if name == "tools" else Turn("ok", "r")
    _, client = await serve(turn, scale_out=True)
    body = {**await rendered(client, name), "stream": True}
    body["stream_options"] = {"include_usage": True}
    body["sampling_params"]["max_tokens"] = 300
    if name == "tools":
        body["reasoning_ended"] = False
    chunks = await stream_events(client, body)
    chat_request = fixture(f"token-in/derender-{name}-request.json")["chat_request"]
    answers = await derender_stream(client, chunks, chat_request, body["token_ids"])
    real = fixture(f"token-in/derender-{name}-stream.json")["responses"]
    # Keys and nesting as the real ones (the values' types follow the text: the real model's
    # first token was reasoning, the fake's is the <think> marker).
    assert keys(answers[0]) == keys(real[0])
    assert keys(answers[-1]) == keys(real[-1])
    states = {tuple(sorted(a["stream_state"])) for a in answers}
    assert states == {tuple(fixture("token-in/experiments.json")["derender_resend"]["state_keys"])}
    assert answers[-1]["stream_state"]["output_token_ids"] == [
        t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]
    ]
    got = joined(answers)
    finish = answers[-2]["chunk"]["choices"][0]["finish_reason"]
    if name == "tools":
        assert got == {
            "content": "ok<|im_end|>",  # the end-of-turn token came alone (below)
            "reasoning": "hm",
            "calls": [{"name": "bash", "arguments": '{"command": "ls -la"}'}],
        }
        assert finish == "tool_calls"
        ids = [
            c["id"]
            for a in answers
            for ch in a["chunk"]["choices"]
            for c in ch["delta"].get("tool_calls") or []
            if c["id"]
        ]
        assert len(ids) == 1
        assert ids[0].startswith("chatcmpl-tool-")
    else:
        # One call per event: the end-of-turn token came alone, and vLLM 0.32's streamed
        # derender keeps its text (DESIGN §11; the proxy sends it without that token).
        assert got == {"content": "ok<|im_end|>", "reasoning": "r", "calls": []}
        assert finish == "stop"


async def test_coalesced_generate_chunks_derender_to_the_same_message(serve: Serve) -> None:
    _, client = await serve(Turn("hello there", reasoning="hm", tool_calls=[LS]), scale_out=True)
    body = {**await rendered(client, "tools"), "stream": True, "reasoning_ended": False}
    body["sampling_params"]["max_tokens"] = 300
    chunks = await stream_events(client, body)
    chat_request = fixture("token-in/derender-tools-request.json")["chat_request"]
    per_token = joined(await derender_stream(client, chunks, chat_request, [1]))
    merged = {**chunks[1], "choices": [dict(chunks[1]["choices"][0])]}
    merged["choices"][0]["token_ids"] = [
        t for c in chunks[1:-1] for t in c["choices"][0]["token_ids"]
    ]
    three = [chunks[0], merged, chunks[-1]]
    assert joined(await derender_stream(client, three, chat_request, [1])) == per_token


@pytest.mark.parametrize("missing", ["chat_request", "prompt_token_ids"])
async def test_derender_refuses_a_call_without_the_chat_request_or_prompt_ids(
    serve: Serve, missing: str
) -> None:
    real = fixture("token-in/derender-chat-request.json")
    del real[missing]
    _, client = await serve(scale_out=True)
    got = await post(client, DERENDER, real, status=400)
    resend = fixture("token-in/experiments.json")["derender_resend"]
    case = "no_chat_request" if missing == "chat_request" else "no_prompt_ids"
    assert got == resend[case]["errors"][0]["body"]


async def test_render_continues_the_final_message_when_asked(serve: Serve) -> None:
    fake, client = await serve(scale_out=True)
    request = fixture("token-in/render-continue-request.json")
    messages = request["messages"]
    cont = (await post(client, RENDER, request))["token_ids"]
    closed = fake.tokenize_chat(messages, add_generation_prompt=False)
    assert closed[: len(cont)] == cont
    assert closed[len(cont) :] == [2, ord("\n") + 16]
    no_gen = await post(client, RENDER, {"messages": messages[:-1], "add_generation_prompt": False})
    assert no_gen["token_ids"] == fake.tokenize_chat(messages[:-1], add_generation_prompt=False)


async def test_generate_answers_a_scripted_fault(serve: Serve) -> None:
    from capture_proxy.testing.fake_vllm import Fault

    _, client = await serve(Turn("x", fault=Fault.http_error(500)), scale_out=True)
    got = await post(client, GENERATE, await rendered(client, "chat"), status=500)
    assert got["error"]["code"] == 500


IMAGE_A = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
IMAGE_B = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}


async def test_render_answers_the_features_of_each_image_and_generate_takes_them(
    serve: Serve,
) -> None:
    _, client = await serve(Turn("seen"), Turn("seen"), scale_out=True)
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE_A]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [IMAGE_B, {"type": "text", "text": "and b"}]},
        ]
    }
    answer = await post(client, RENDER, body)
    features = answer["features"]
    assert set(features) == {"mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"}
    a, b = features["mm_hashes"]["image"]
    assert a != b
    ids = answer["token_ids"]
    for span in features["mm_placeholders"]["image"]:
        assert span["length"] == 1
        assert ids[span["offset"]] == 9  # <|image_pad|>
    assert len(features["kwargs_data"]["image"]) == 2
    assert (await post(client, GENERATE, answer))["choices"][0]["finish_reason"] == "stop"
    # An item without its data is looked up by hash: this fake rendered it.
    cached = {**features, "kwargs_data": {"image": [None, features["kwargs_data"]["image"][1]]}}
    assert (await post(client, GENERATE, {**answer, "features": cached}))["choices"]
    # A text-only prompt has none.
    assert (await post(client, RENDER, {"messages": [{"role": "user", "content": "a"}]}))[
        "features"
    ] is None


async def test_generate_refuses_features_that_do_not_fit_the_prompt(serve: Serve) -> None:
    _, client = await serve(scale_out=True)
    body = {"messages": [{"role": "user", "content": [IMAGE_A]}]}
    answer = await post(client, RENDER, body)
    features = answer["features"]
    [span] = features["mm_placeholders"]["image"]
    moved = {**features, "mm_placeholders": {"image": [{**span, "offset": span["offset"] - 1}]}}
    wrong = {**features, "kwargs_data": {"image": ["eHl6"]}}
    unknown = {**features, "mm_hashes": {"image": ["0" * 64]}, "kwargs_data": None}
    none = {**features, "mm_hashes": {}, "mm_placeholders": {}}
    cases = [
        (moved, "is not an image's"),
        (wrong, "does not match"),
        (unknown, "does not match"),
        (none, "the features place 0 image tokens, the prompt has 1 image pads"),
    ]
    for bad, message in cases:
        got = await post(client, GENERATE, {**answer, "features": bad}, status=400)
        assert message in got["error"]["message"]
