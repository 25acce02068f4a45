"""Where vLLM 0.32's derender answers differently from its chat route, the fake does the same:
held to tests/fixtures/vllm-0.32.0/token-in/parity-*.json, captured from the real tiny vLLM by
``scripts/capture_token_in_fixtures.py --only-parity`` (the same request through the chat route,
generate and derender; what each gave in ``parity-experiments.json``)."""

from __future__ import annotations

import copy
import re
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


def _token_id_rules(entries: list[Any], ids: list[int]) -> None:
    """vLLM 0.32's chat route with ``return_tokens_as_token_ids``: each entry's token is
    ``"token_id:N"`` for the id sampled there, its bytes its decoded text's (a character split
    across tokens: empty, then whole), each top entry's token and bytes its ``"token_id:N"``."""
    assert [e["token"] for e in entries] == [f"token_id:{i}" for i in ids]
    for e in entries:
        assert e["top_logprobs"]
        for top in e["top_logprobs"]:
            assert top["token"].startswith("token_id:")
            assert bytes(top["bytes"]) == top["token"].encode()


async def test_logprobs_as_token_ids_are_the_chat_route_s_and_derender_s_are_text(
    serve: Serve,
) -> None:
    case = fixture("token-in/parity-logprobs-as-token-ids.json")
    real = case["chat_response"]["choices"][0]
    _token_id_rules(real["logprobs"]["content"], real["token_ids"])
    real_text = b"".join(bytes(e["bytes"]) for e in real["logprobs"]["content"])
    assert real_text == "</think>Done. é<|im_end|>".encode()
    real_derender = case["derender_response"]["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in real_derender) == real_text.decode()
    chat = {**case["chat_request"], "messages": USER}
    chat.pop("structured_outputs")
    chat.pop("logit_bias")
    _, client = await serve(*[Turn("Done. é", reasoning=None)] * 3, scale_out=True)
    said = (await post(client, "/v1/chat/completions", chat))["choices"][0]
    _token_id_rules(said["logprobs"]["content"], said["token_ids"])
    text = b"".join(bytes(e["bytes"]) for e in said["logprobs"]["content"])
    assert text == "Done. é<|im_end|>".encode()
    *_, unary = await through_derender(client, chat)
    derendered = unary["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in derendered) == text.decode()


async def test_a_named_tool_call_finishes_with_stop_and_derender_s_unary_id_is_bare_hex(
    serve: Serve,
) -> None:
    case = fixture("token-in/parity-tool-call-named.json")
    chat_id = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")
    real = case["chat_response"]["choices"][0]
    assert real["finish_reason"] == "stop"
    assert chat_id.fullmatch(real["message"]["tool_calls"][0]["id"])
    real_stream = [orjson.loads(e) for e in events(case["chat_stream"].encode())[:-1]]
    real_choices = [c for e in real_stream for c in e["choices"]]
    assert [c["finish_reason"] for c in real_choices if c["finish_reason"]] == ["stop"]
    [real_streamed_id] = [
        t["id"] for c in real_choices for t in c["delta"].get("tool_calls") or () if "id" in t
    ]
    assert chat_id.fullmatch(real_streamed_id)
    real_derender = case["derender_response"]["choices"][0]["message"]["tool_calls"][0]["id"]
    assert re.fullmatch(r"[0-9a-f]{16}", real_derender)
    _, client = await serve(
        *[Turn(tool_calls=[FakeToolCall("bash", {"n": 5})])] * 4, scale_out=True
    )
    chat = {**case["chat_request"], "tools": TOOLS}
    said = (await post(client, "/v1/chat/completions", chat))["choices"][0]
    assert said["finish_reason"] == "stop"
    assert chat_id.fullmatch(said["message"]["tool_calls"][0]["id"])
    raw = await client.post("/v1/chat/completions", json={**chat, "stream": True})
    choices = [c for e in events(await raw.read())[:-1] for c in orjson.loads(e)["choices"]]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop"]
    [streamed_id] = [
        t["id"] for c in choices for t in c["delta"].get("tool_calls") or () if t.get("id")
    ]
    assert chat_id.fullmatch(streamed_id)
    *_, unary = await through_derender(client, chat)
    assert re.fullmatch(r"[0-9a-f]{16}", unary["choices"][0]["message"]["tool_calls"][0]["id"])


def _running_usage(chunks: list[Any]) -> list[tuple[int, int]]:
    """Each chunk's (completion tokens, reasoning tokens); every chunk must carry usage."""
    assert all(c.get("usage") for c in chunks)
    return [
        (
            c["usage"]["completion_tokens"],
            c["usage"]["completion_tokens_details"]["reasoning_tokens"],
        )
        for c in chunks
    ]


async def test_a_stream_with_continuous_usage_counts_through_every_chunk(serve: Serve) -> None:
    # vLLM 0.32's chat route: the role chunk counts none, each chunk the tokens so far (one the
    # parser swallowed counted in the next), the finish chunk as much as the usage chunk.
    case = fixture("token-in/parity-continuous-usage.json")
    options = case["chat_stream_options"]
    real = _running_usage([orjson.loads(e) for e in events(case["chat_stream"].encode())[:-1]])
    assert real[0] == (0, 0)
    assert real[-2] == real[-1] == (7, 0)
    assert [n for n, _ in real] == sorted(n for n, _ in real)
    _, client = await serve(Turn("Done.", reasoning="ok"))
    chat = {"model": "policy", "messages": USER, "stream": True, "stream_options": options}
    raw = await client.post("/v1/chat/completions", json=chat)
    said = _running_usage([orjson.loads(e) for e in events(await raw.read())[:-1]])
    assert said[0] == (0, 0)
    assert said[-2] == said[-1]
    assert [n for n, _ in said] == sorted(n for n, _ in said)
    assert said[1][0] > 1  # the `<think>` block's markers have no chunk: counted in the next
    assert said[-1][1] > 0  # the reasoning, counted as it streams


def _streamed_args(chunks: list[Any]) -> str:
    return "".join(
        (t.get("function") or {}).get("arguments") or ""
        for c in chunks
        for choice in c["choices"]
        for t in choice["delta"].get("tool_calls") or ()
    )


async def test_a_stop_string_in_tool_arguments_cuts_the_chat_route_s_stream_only(
    serve: Serve,
) -> None:
    # vLLM cuts the text its tool parser reads: the chat route streams the arguments up to the
    # stop string and says "tool_calls"; its unary answer has the cut block as content; the
    # streamed derender has the arguments whole.
    case = fixture("token-in/parity-tool-call-stop-string.json")
    real = [orjson.loads(e) for e in events(case["chat_stream"].encode())[:-1]]
    assert _streamed_args(real) == '{"command": "ls -'
    finishes = [(c["finish_reason"], c.get("stop_reason")) for e in real for c in e["choices"]]
    assert [f for f in finishes if f[0]] == [("tool_calls", "la")]
    unary = case["chat_response"]["choices"][0]
    assert unary["message"]["content"].endswith('"ls -')
    assert (unary["finish_reason"], unary["stop_reason"]) == ("stop", "la")
    real_derender = [a["chunk"] for a in case["derender_stream"]]
    assert _streamed_args(real_derender) == '{"command": "ls -la'
    call = FakeToolCall("bash", {"command": "ls -la"})
    _, client = await serve(*[Turn(tool_calls=[call])] * 4, scale_out=True)
    chat = {"model": "policy", "messages": USER, "tools": TOOLS, "stop": ["la"]}
    said = (await post(client, "/v1/chat/completions", chat))["choices"][0]
    assert said["message"]["content"].endswith('"ls -')
    assert (said["finish_reason"], said["stop_reason"]) == ("stop", "la")
    raw = await client.post("/v1/chat/completions", json={**chat, "stream": True})
    chunks = [orjson.loads(e) for e in events(await raw.read())[:-1]]
    assert _streamed_args(chunks) == '{"command": "ls -'
    finishes = [(c["finish_reason"], c.get("stop_reason")) for e in chunks for c in e["choices"]]
    assert [f for f in finishes if f[0]] == [("tool_calls", "la")]
    _, _, answers, _ = await through_derender(client, chat)
    assert _streamed_args([a["chunk"] for a in answers]) == '{"command": "ls -la'
