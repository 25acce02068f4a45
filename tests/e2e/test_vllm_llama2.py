"""Token-in with a Llama-2-style template against the real vLLM 0.32 (`-m vllm`).

Llama-2's chat template closes an assistant turn with ``' ' + content.strip() + ' ' +
eos_token``: a plain token (a space) before the end-of-sequence token, which the model samples
without the space. The requests bring the template themselves (`LLAMA2_TEMPLATE`, the
``chat_template`` request field, which the `vllm_url` server trusts:
``--trust-request-chat-template``), written from the tokenizer's own ``eos_token`` (the tiny
model's ``<|im_end|>``), in the layout of the fake vLLM's ``chat_template="llama2"``
(capture_proxy/testing/fake_vllm/_llama2.py), which the first test holds to it.
The tiny model answers noise: ``logit_bias`` and ``structured_outputs`` steer it where a call
needs an end of turn, a tool call or the other end of sequence (as tests/e2e/test_vllm_parity.py).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.token_in_extras import plain_divergence_of, segment_break_of
from capture_proxy.testing.fake_vllm import FakeVLLM
from examples.rl_loop.agent import TOOLS
from tests.e2e.test_vllm import IM_END, steer_tool_call
from tests.e2e.test_vllm_parity import (
    ENDOFTEXT,
    says,
    views_that_differ,
)
from tests.support.proxy_harness import Proxy, start_proxy, stop_proxy

pytestmark = pytest.mark.vllm

#: Llama-2's template (its ``tokenizer_config.json``: ``[INST]`` turns, ``<<SYS>>`` in the
#: first one, ``' ' + content.strip() + ' ' + eos_token`` for an answer) without the ``<s>``
#: before each ``[INST]``, with the tools in the system block and hermes tool calls and results,
#: as the fake's ``llama2`` template writes them.
LLAMA2_TEMPLATE = r"""
{%- set ns = namespace(system='', body='') -%}
{%- set turns = messages -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set ns.system = messages[0].content -%}{%- set turns = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
{%- if ns.system -%}{%- set ns.system = ns.system + '\n\n' -%}{%- endif -%}
{%- set ns.system = ns.system + '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -%}
{%- for t in tools -%}{%- set ns.system = ns.system + '\n' + (t | tojson) -%}{%- endfor -%}
{%- set ns.system = ns.system + '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -%}
{%- endif -%}
{%- for m in turns -%}
{%- if m.role == 'assistant' -%}
{%- set ns.body = m.content or '' -%}
{%- for tc in m.tool_calls or [] -%}
{%- set f = tc.function -%}
{%- if ns.body or not loop.first -%}{%- set ns.body = ns.body + '\n' -%}{%- endif -%}
{%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) -%}
{%- set ns.body = ns.body + '<tool_call>\n{"name": "' + f.name + '", "arguments": ' + args + '}\n</tool_call>' -%}
{%- endfor -%}
{{- ' ' + ns.body.strip() + ' ' + eos_token -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or turns[loop.index0 - 1].role != 'tool' -%}{{- '[INST] ' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_response>\n' + m.content + '\n</tool_response>' -}}
{%- if loop.last or turns[loop.index0 + 1].role != 'tool' -%}{{- ' [/INST]' -}}{%- endif -%}
{%- else -%}
{%- set text = m.content.strip() -%}
{%- if ns.system -%}{%- set text = '<<SYS>>\n' + ns.system + '\n<</SYS>>\n\n' + text -%}{%- set ns.system = '' -%}{%- endif -%}
{{- '[INST] ' + text + ' [/INST]' -}}
{%- endif -%}
{%- endfor -%}
""".strip()  # noqa: E501

SYSTEM = {"role": "system", "content": "You are a shell agent."}
USER = {"role": "user", "content": "List the files here."}
#: A conversation with every kind of turn the template writes.
CONVERSATION: list[dict[str, Any]] = [
    SYSTEM,
    USER,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command":"ls"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    {"role": "tool", "tool_call_id": "call_1", "content": "b.txt"},
    {"role": "assistant", "content": " Two files. ", "reasoning_content": "Count them."},
    {"role": "user", "content": "Thanks."},
]


def llama2(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": "policy", "temperature": 0, **body, "chat_template": LLAMA2_TEMPLATE}


async def post(url: str, path: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_the_fake_s_llama2_template_renders_what_vllm_renders_with_llama2_s(
    vllm_url: str,
) -> None:
    """vLLM's render of a conversation with `LLAMA2_TEMPLATE` is the tokenizer's ids for the
    text the fake renders with its ``llama2`` template (vLLM re-serializes replayed tool
    arguments, as the fake's ``reparse_tool_arguments``), and an assistant turn closes with
    the tokenizer's space, then its end of sequence, the id generation stops on."""
    body = llama2({"messages": CONVERSATION, "tools": TOOLS, "add_generation_prompt": False})
    rendered = (await post(vllm_url, "/v1/chat/completions/render", body))["token_ids"]
    fake = FakeVLLM(chat_template="llama2", reparse_tool_arguments=True)
    text = fake._render(CONVERSATION, TOOLS, False)
    tokenized = await post(vllm_url, "/tokenize", {"model": "policy", "prompt": text})
    assert rendered == tokenized["tokens"]
    space = await post(vllm_url, "/tokenize", {"model": "policy", "prompt": " "})
    assert await close_of(vllm_url) == [*space["tokens"], int(IM_END)]


async def close_of(url: str) -> list[int]:
    """What vLLM's render writes after an assistant turn's content with `LLAMA2_TEMPLATE`: the
    common tail of two conversations that differ only in that content."""
    tails = []
    for content in ("A", "B"):
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": content}]
        body = llama2({"messages": messages, "add_generation_prompt": False})
        tails.append((await post(url, "/v1/chat/completions/render", body))["token_ids"])
    a, b = tails
    n = 0
    while a[-1 - n] == b[-1 - n]:
        n += 1
    return list(a[len(a) - n :])


async def ask(p: Proxy, messages: list[dict[str, Any]], steer: dict[str, Any]) -> dict[str, Any]:
    """One call through the proxy; the assistant message as an agent replays it."""
    resp = await p.chat(llama2({"messages": messages, "tools": TOOLS, **steer}))
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Capture-Status"] == "staged"
    message = (await resp.json())["choices"][0]["message"]
    replayed: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
    if message.get("reasoning"):
        replayed["reasoning"] = message["reasoning"]
    if message.get("tool_calls"):
        replayed["tool_calls"] = message["tool_calls"]
    return replayed


async def test_a_llama2_session_against_vllm_is_one_segment_with_the_close_placed_once(
    vllm_url: str, tmp_path: Path
) -> None:
    """A tool call and an answer that end on the sampled `<|im_end|>` (nothing inserted: the
    template's space comes before it), an answer cut by `length` (the close inserted once,
    as vLLM's own render writes it), then one that ends on `<|endoftext|>`, which the close
    does not hold: the next call starts a new segment (`stopped_on_other_token`)."""
    close = await close_of(vllm_url)
    assert close[-1] == int(IM_END)
    assert len(close) == 2  # a space, then the end of sequence
    p = await start_proxy(tmp_path, upstream=vllm_url, token_in="on")
    try:
        messages: list[dict[str, Any]] = [SYSTEM, USER]
        replayed = await ask(p, messages, steer_tool_call("ls"))
        assert replayed["tool_calls"]
        call_id = replayed["tool_calls"][0]["id"]
        messages += [replayed, {"role": "tool", "tool_call_id": call_id, "content": "a.txt"}]
        messages += [
            await ask(p, messages, says(r"One file\.")),
            {"role": "user", "content": "More."},
        ]
        messages += [
            await ask(p, messages, {"max_tokens": 6}),
            {"role": "user", "content": "Again."},
        ]
        steer = {"logit_bias": {ENDOFTEXT: 100}, "max_tokens": 4}
        messages += [await ask(p, messages, steer), {"role": "user", "content": "Last."}]
        await ask(p, messages, {"max_tokens": 4})
        records = p.calls()
    finally:
        await stop_proxy(p)
    assert [r.finish_reason for r in records] == ["tool_calls", "stop", "length", "stop", "length"]
    assert all(r.token_in for r in records)
    assert [r.completion_token_ids[-1] for r in records[:2]] == [int(IM_END)] * 2
    assert records[3].completion_token_ids[-1] == int(ENDOFTEXT)
    for before, after in itertools.pairwise(records[:4]):
        sent = [*before.prompt_token_ids, *before.completion_token_ids]
        assert list(after.prompt_token_ids[: len(sent)]) == sent
        assert segment_break_of(after.extras) is None
    # After the sampled `<|im_end|>`: nothing inserted (never the space after it, nor a second
    # `<|im_end|>`); after the `length` cut: the whole close once, as vLLM renders it.
    assert [r.bridge_spans for r in records[1:3]] == [(), ()]
    [(start, end, reason)] = records[3].bridge_spans
    assert start == len(records[2].prompt_token_ids) + len(records[2].completion_token_ids)
    assert (list(records[3].prompt_token_ids[start:end]), reason) == (close, "end_of_turn_added")
    # The plain rendering writes the space the model did not sample: token-in kept its tokens.
    assert all(plain_divergence_of(r.extras)[1] is not None for r in records[1:4])
    cut = segment_break_of(records[4].extras)
    assert cut is not None
    assert cut.reason == "stopped_on_other_token"
    traj = open_store(p.store_url).trajectory("r1", include_open=True)
    assert [len(s.call_ids) for s in traj.segments] == [4, 1]
    assert traj.drift == []


#: name -> the request's extra fields, with `LLAMA2_TEMPLATE`.
SHAPES: dict[str, dict[str, Any]] = {
    "end of turn": says(r"Done\."),
    "end of turn after a space": says(r"Done\. "),
    "other end of sequence": {"logit_bias": {ENDOFTEXT: 100}, "min_tokens": 3, "max_tokens": 6},
    "stop string": says(r"Done\. Gone\.", stop=["on"]),
    "length": {"max_tokens": 6},
    "tool call": {**steer_tool_call("ls -la"), "tools": TOOLS},
    "earlier turns": {
        "messages": [USER, {"role": "assistant", "content": "Said. "}, USER],
        **says(r"Again\."),
    },
}


async def test_token_in_answers_what_vllms_chat_route_answers_with_a_llama2_template(
    vllm_url: str, tmp_path: Path
) -> None:
    """Each shape, unary and streamed, greedy, through the plain path and token-in: the agent's
    view and the staged message are equal, where both sampled the same ids (as
    tests/e2e/test_vllm_parity.py, whose retries this takes: a shape whose ids differ, or whose
    streamed views differ only in the chat route's own unsteady reasoning count, is sent
    again)."""
    plain = await start_proxy(tmp_path / "plain", upstream=vllm_url)
    token_in = await start_proxy(tmp_path / "token-in", upstream=vllm_url, token_in="on")
    try:
        bodies = []
        for name, extra in SHAPES.items():
            for stream in (False, True):
                body = llama2({"messages": [USER], **extra})
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                bodies.append((name, stream, body))
        differ = await views_that_differ(plain, token_in, bodies)
    finally:
        await stop_proxy(plain)
        await stop_proxy(token_in)
    assert differ == {}
