"""Where vLLM 0.32's derender answers differently from its chat route, the fake does the same:
held to tests/fixtures/vllm-0.32.0/token-in/parity-*.json, captured from the real tiny vLLM by
``scripts/capture_token_in_fixtures.py --only-parity`` (the same request through the chat route,
generate and derender; what each gave in ``parity-experiments.json``)."""

from __future__ import annotations

import copy
from typing import Any

import orjson

from capture_proxy.testing.fake_vllm import FakeToolCall, Turn
from tests.testing.test_fake_token_in import (
    DERENDER,
    GENERATE,
    RENDER,
    derender_stream,
    post,
    serve,
    stream_events,
)
from tests.testing.test_fake_vllm import Client, Serve, events, fixture

__all__ = ["serve"]

REAL = fixture("token-in/parity-experiments.json")
USER = [{"role": "user", "content": "Say it."}]
TOOLS = fixture("token-in/parity-tool-call-length.json")["chat_request"]["tools"]


def streamed_content(answers: list[Any]) -> str:
    return "".join(c["delta"].get("content") or "" for a in answers for c in a["chunk"]["choices"])


async def through_derender(
    client: Client, chat: dict[str, Any]
) -> tuple[dict[str, Any], list[Any], list[Any], dict[str, Any]]:
    """Render `chat`, generate it unary and streamed; derender both (the stream one call per
    event). (render answer, stream events, streamed derender answers, unary derender answer)."""
    rendered = await post(client, RENDER, chat)
    body = {**rendered, "stream": True, "stream_options": {"include_usage": True}}
    chunks = await stream_events(client, body)
    answers = await derender_stream(client, chunks, chat, rendered["token_ids"])
    generated = await post(client, GENERATE, rendered)
    unary = await post(
        client,
        DERENDER,
        {
            "generate_response": generated,
            "prompt_token_ids": rendered["token_ids"],
            "chat_request": chat,
        },
    )
    return rendered, chunks, answers, unary


async def test_an_end_of_turn_token_alone_in_a_streamed_chunk_keeps_its_text(
    serve: Serve,
) -> None:
    real = REAL["end-of-turn"]
    assert real["derender_stream_content"] == real["chat_content"] + "<|im_end|>"
    assert real["derender_content"] == real["chat_content"]  # the unary derender skips it
    _, client = await serve(Turn("Done."), Turn("Done."), scale_out=True)
    chat = {"model": "policy", "messages": USER, "temperature": 0}
    rendered, chunks, answers, unary = await through_derender(client, chat)
    assert streamed_content(answers) == "Done.<|im_end|>"
    assert unary["choices"][0]["message"]["content"] == "Done."
    # The last chunk sent without its end-of-turn id: no text, the finish kept (as the real one).
    last = max(i for i, c in enumerate(chunks) if c["choices"])
    stripped = copy.deepcopy(chunks[last])
    stripped["choices"][0]["token_ids"] = stripped["choices"][0]["token_ids"][:-1]
    body = {
        "stream": True,
        "generate_chunk": stripped,
        "stream_state": answers[last - 1]["stream_state"],
        "prompt_token_ids": rendered["token_ids"],
        "chat_request": chat,
    }
    [choice] = (await post(client, DERENDER, body))["chunk"]["choices"]
    want = real["last_chunk_without_its_id"]
    assert (choice["delta"]["content"], choice["finish_reason"]) == (
        want["delta"]["content"],
        want["finish_reason"],
    )


async def test_generate_stops_on_a_stop_string_and_only_the_chat_route_cuts_it(
    serve: Serve,
) -> None:
    real = REAL["stop-string"]
    assert (real["generate_finish"], real["generate_stop_reason"]) == ("stop", "on")
    assert (real["chat_content"], real["derender_content"]) == ("D", "Don")
    _, client = await serve(*[Turn("Done. Gone.")] * 3, scale_out=True)
    chat = {"model": "policy", "messages": USER, "temperature": 0, "stop": ["on"]}
    said = await post(client, "/v1/chat/completions", chat)
    assert said["choices"][0]["message"]["content"] == "D"
    assert said["choices"][0]["stop_reason"] == "on"
    _, chunks, answers, unary = await through_derender(client, chat)
    [last] = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "on")
    assert unary["choices"][0]["message"]["content"] == "Don"
    assert streamed_content(answers) == "Don"


async def test_a_streamed_tool_call_cut_by_length_says_tool_calls_in_derender_only(
    serve: Serve,
) -> None:
    real = REAL["tool-call-length"]
    assert (real["generate_finish"], real["derender_stream_finish"]) == ("length", "tool_calls")
    chat_stream = fixture("token-in/parity-tool-call-length.json")["chat_stream"]
    real_chat = [orjson.loads(e) for e in events(chat_stream.encode())[:-1]]
    assert [c["finish_reason"] for e in real_chat for c in e["choices"] if c["finish_reason"]] == [
        "length"
    ]
    call = FakeToolCall("bash", {"command": "ls -la /tmp/a/long/path"})
    _, client = await serve(Turn(tool_calls=[call]), scale_out=True)
    chat = {"model": "policy", "messages": USER, "tools": TOOLS, "max_tokens": 60}
    _, chunks, answers, _ = await through_derender(client, chat)
    finishes = [c["finish_reason"] for a in answers for c in a["chunk"]["choices"]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert finishes[-1] == "tool_calls"


async def test_a_continued_message_whose_reasoning_closed_ends_it_and_still_counts_reasoning(
    serve: Serve,
) -> None:
    # Render says the prompt ended the reasoning; the chat route counts every token it wrote
    # after it as reasoning all the same (its count does not read the prompt), unary and
    # streamed. (The real unary answer calls the text reasoning, the streamed one content; the
    # fake calls an answer without a think block content: `reasoning_token_count`.)
    case = fixture("token-in/parity-continued-after-reasoning.json")
    real = REAL["continued-after-reasoning"]
    assert real["reasoning_ended"] is True
    usage = real["chat_usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"]
    real_stream = [orjson.loads(e) for e in events(case["chat_stream"].encode())[:-1]]
    assert real_stream[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    chat = case["chat_request"]
    _, client = await serve(*[Turn("Ok" * 8)] * 3, scale_out=True)
    assert (await post(client, RENDER, chat))["reasoning_ended"] is True
    said = await post(client, "/v1/chat/completions", chat)
    assert said["choices"][0]["finish_reason"] == "length"
    assert said["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    raw = await client.post(
        "/v1/chat/completions",
        json={**chat, "stream": True, "stream_options": {"include_usage": True}},
    )
    streamed = [orjson.loads(e) for e in events(await raw.read())[:-1]]
    assert streamed[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
