"""Token-in gives the agent what the chat route gives, against the fake vLLM (docs/token-in.md,
"What the agent gets").

The same scripted answer (so the same sampled tokens) goes through a proxy on the plain path and
one with token-in on, unary and streamed, over the request shapes the chat route knows; the
answers are compared field by field (ids and timestamps aside, tool call ids by their form) and
so are the staged records.
The fake is held to vLLM 0.32's derender (tests/testing/test_fake_token_in.py): its streamed
route keeps an end-of-turn token's text when alone in a chunk, does not cut stop strings, says
``tool_calls`` for a tool call cut by ``length``.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
from tests.support.parity import agent_view, id_form
from tests.support.proxy_harness import Proxy, chat_body, user

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
LS = FakeToolCall("bash", {"command": "ls -la /tmp"})
SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"n": {}}}},
}

#: A final assistant message, continued (its reasoning closed in the prompt).
CONTINUED: dict[str, Any] = {
    "messages": [
        user("Tell me."),
        {"role": "assistant", "reasoning_content": "Fine.", "content": "Said"},
    ],
    "continue_final_message": True,
    "add_generation_prompt": False,
}

#: name -> (the scripted answer, the request's extra fields).
SHAPES: dict[str, tuple[Turn, dict[str, Any]]] = {
    "plain": (Turn("Done.", reasoning="ok"), {}),
    "empty answer": (Turn(""), {}),
    "stop string": (Turn("Done. Gone.", reasoning="hm"), {"stop": ["on"]}),
    "stop string kept": (
        Turn("Done. Gone.", reasoning="hm"),
        {"stop": ["on", "xyz"], "include_stop_str_in_output": True},
    ),
    "stop after min_tokens": (
        Turn("on and on again", reasoning=None),
        {"stop": "on", "min_tokens": 4},
    ),
    "stop in reasoning": (Turn("Fine.", reasoning="one two"), {"stop": ["two"]}),
    "tool call": (Turn(reasoning="look", tool_calls=[LS]), {"tools": TOOLS}),
    "tool call required": (
        Turn(tool_calls=[LS]),
        {"tools": TOOLS, "tool_choice": "required"},
    ),
    "tool choice none": (Turn(tool_calls=[LS]), {"tools": TOOLS, "tool_choice": "none"}),
    "length mid tool arguments": (
        Turn(reasoning="look", tool_calls=[LS]),
        {"tools": TOOLS, "max_tokens": 40},
    ),
    "length mid content": (Turn("a long answer indeed"), {"max_tokens": 7}),
    "json schema": (Turn('{"n": 1}'), {"response_format": SCHEMA}),
    "reasoning off": (
        Turn("Plain.", reasoning="unseen"),
        {"chat_template_kwargs": {"enable_thinking": False}},
    ),
    "logprobs": (Turn("Yes.", reasoning="r"), {"logprobs": True, "top_logprobs": 2}),
    "token ids": (Turn("Ids.", reasoning="r"), {"return_token_ids": True}),
    "logprobs without top": (Turn("Yes.", reasoning="r"), {"logprobs": True}),
    # `return_tokens_as_token_ids`: logprob tokens (and top entries' bytes) as "token_id:N".
    "logprobs as token ids": (
        Turn("Yes. é", reasoning="r"),
        {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True},
    ),
    "tool call logprobs as token ids": (
        Turn(reasoning="look", tool_calls=[LS]),
        {"tools": TOOLS, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True},
    ),
    "token ids as strings without logprobs": (Turn("No."), {"return_tokens_as_token_ids": True}),
    "tool call with a stop string": (Turn(tool_calls=[LS]), {"tools": TOOLS, "stop": ["-la"]}),
    "tool call with a stop string kept": (
        Turn(tool_calls=[LS]),
        {"tools": TOOLS, "stop": ["-la"], "include_stop_str_in_output": True},
    ),
    "tool call with stop strings not met": (
        Turn(tool_calls=[LS]),
        {"tools": TOOLS, "stop": ["xyz", "nowhere"]},
    ),
    "tool choice named": (
        Turn(tool_calls=[LS]),
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "bash"}}},
    ),
    "stream without usage": (Turn("Done.", reasoning="ok"), {"stream_options": None}),
    "stream with continuous usage": (
        Turn("Done.", reasoning="ok"),
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ),
    "tool call with continuous usage": (
        Turn(reasoning="look", tool_calls=[LS]),
        {
            "tools": TOOLS,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    "stream usage not asked": (
        Turn("Done.", reasoning="ok"),
        {"stream_options": {"include_usage": False}},
    ),
    # The prompt ends the reasoning (render's `reasoning_ended`), but vLLM's count starts in
    # reasoning whatever the prompt: the answer is content, and counted as reasoning.
    "continued after closed reasoning": (Turn(" and more.", reasoning=None), CONTINUED),
    "continued to a stop string": (
        Turn(" Done. Gone.", reasoning=None),
        {**CONTINUED, "stop": ["on"]},
    ),
    "continued to a tool call": (Turn(tool_calls=[LS]), {**CONTINUED, "tools": TOOLS}),
    "continued inside reasoning": (
        Turn(" and more.", reasoning=None),
        {**CONTINUED, "messages": [user("Tell me."), {"role": "assistant", "content": "<think>"}]},
    ),
    "continued with thinking off": (
        Turn(" and more.", reasoning=None),
        {**CONTINUED, "chat_template_kwargs": {"enable_thinking": False}},
    ),
}


async def through(
    make_proxy: Any,
    token_in: str,
    turn: Turn,
    body: dict[str, Any],
    *,
    chunk_delay: float = 0.0,
    chat_template: str = "chatml",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent's view of one call, and the staged record's message and finish reason
    (`chat_template`: the fake's)."""
    fake = FakeVLLM(scale_out=True, chunk_delay=chunk_delay, chat_template=chat_template)
    p: Proxy = await make_proxy(fake=fake, token_in=token_in)
    p.fake.push(turn)
    view = await agent_view(p.chat, body)
    [record] = p.calls()
    assert record.token_in is (token_in == "on")
    message = record.response
    staged = {
        "content": message.get("content"),
        "reasoning": message.get("reasoning_content"),
        "tool_calls": [
            (id_form(c["id"]), c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or ()
        ],
        "finish_reason": record.finish_reason,
        "completion_token_ids": list(record.completion_token_ids),
    }
    return view, staged


def request(extra: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The shape's body; its ``stream_options`` (None: none) only when streamed, else
    ``include_usage``."""
    extra = dict(extra)
    options = extra.pop("stream_options", {"include_usage": True})
    body = chat_body(user("Tell me."), temperature=0, **extra)
    if stream:
        body["stream"] = True
        if options is not None:
            body["stream_options"] = options
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_token_in_answers_what_the_chat_route_answers(
    make_proxy: Any, shape: str, stream: bool
) -> None:
    turn, extra = SHAPES[shape]
    body = request(extra, stream)
    plain_view, plain_staged = await through(make_proxy, "off", turn, body)
    token_view, token_staged = await through(make_proxy, "on", turn, body)
    assert token_view == plain_view
    assert token_staged == plain_staged


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_several_choices_are_refused_alike_on_both_paths(
    make_proxy: Any, stream: bool
) -> None:
    # `n` above 1: one sampled completion per call is staged, on either path (the request
    # policy), so token-in has no answer of its own to compare.
    answers = []
    for token_in in ("off", "on"):
        p: Proxy = await make_proxy(fake=FakeVLLM(scale_out=True), token_in=token_in)
        resp = await p.chat(request({"n": 2}, stream))
        answers.append((resp.status, await resp.json()))
        assert p.calls() == []
    assert answers[0] == answers[1]
    assert answers[0][0] == 422
    assert answers[0][1]["error"]["param"] == "n"


async def test_streamed_content_never_ends_with_the_end_of_turn_text(make_proxy: Any) -> None:
    # Each event comes after the previous derender call returned: the end-of-turn token goes
    # alone, where vLLM 0.32's streamed derender keeps its text.
    turn, body = Turn("Done.", reasoning="ok"), request({}, stream=True)
    plain_view, _ = await through(make_proxy, "off", turn, body)
    token_view, staged = await through(make_proxy, "on", turn, body, chunk_delay=0.06)
    assert token_view["content"] == plain_view["content"] == "Done."
    assert staged["content"] == "Done."


async def test_a_stop_string_cuts_the_answer_as_the_chat_route_does(make_proxy: Any) -> None:
    turn = Turn("Done.", reasoning=None)
    for stream in (False, True):
        view, staged = await through(make_proxy, "on", turn, request({"stop": ["on"]}, stream))
        content = view["choices"][0]["message"]["content"] if not stream else view["content"]
        assert content == staged["content"] == "D"


async def test_a_streamed_tool_call_cut_by_length_finishes_with_length(make_proxy: Any) -> None:
    turn, extra = SHAPES["length mid tool arguments"]
    view, staged = await through(make_proxy, "on", turn, request(extra, stream=True))
    assert view["finish_reason"] == staged["finish_reason"] == "length"


class NoTokenize(FakeVLLM):
    """A vLLM whose /tokenize fails (the reasoning markers cannot be learnt)."""

    refused = 0

    async def _tokenize(self, request: web.Request) -> web.Response:
        if (await request.json()).get("prompt") in ("<think>", "</think>"):
            self.refused += 1
            return web.json_response({"error": "boom"}, status=500)
        return await super()._tokenize(request)


async def test_without_the_reasoning_markers_the_usage_has_no_reasoning_count(
    make_proxy: Any,
) -> None:
    p: Proxy = await make_proxy(fake=NoTokenize(scale_out=True), token_in="on")
    p.fake.push(Turn("Done.", reasoning="ok"), Turn("Done.", reasoning="ok"))
    for _ in range(2):
        view = await agent_view(p.chat, request({}, stream=False))
        # The answer and its record as ever; only the count the chat route adds is left out.
        assert view["choices"][0]["message"]["content"] == "Done."
        assert "completion_tokens_details" not in view["usage"]
    assert len(p.calls()) == 2
    # Not learnt: asked again by the next call (two /tokenize calls each).
    assert isinstance(p.fake, NoTokenize)
    assert p.fake.refused == 4


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_continued_message_whose_reasoning_closed_counts_its_answer_as_reasoning(
    make_proxy: Any, stream: bool
) -> None:
    # vLLM's count starts in reasoning unless thinking is off, whatever the prompt: every
    # answer token but the end of turn (docs/token-in.md, "What the agent gets").
    turn = Turn(" and more.", reasoning=None)
    p: Proxy = await make_proxy(fake=FakeVLLM(scale_out=True), token_in="on")
    p.fake.push(turn)
    view = await agent_view(p.chat, request(CONTINUED, stream))
    [record] = p.calls()
    assert record.token_in
    content = view["content"] if stream else view["choices"][0]["message"]["content"]
    assert content == record.response["content"] == " and more."
    assert not record.response.get("reasoning_content")
    answer_tokens = len(record.completion_token_ids) - 1
    assert view["usage"]["completion_tokens_details"] == {"reasoning_tokens": answer_tokens}
    assert answer_tokens > 0
