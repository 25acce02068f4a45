"""What a derender call resends (`derender_prompt_start`, `derender_chat_request`), and the
coalescer's byte budget (`DerenderCoalescer`), sans-IO. That vLLM answers the same for them is
shown against the real vLLM by tests/e2e/test_vllm_parity.py."""

from __future__ import annotations

from array import array

import orjson

from capture_proxy.adapters.vllm import (
    SEED_IDS,
    DerenderCoalescer,
    chunk_without_logprobs,
    derender_chat_request,
    derender_prompt_start,
)
from capture_proxy.adapters.vllm._generate import GenerateEvent

THINK, END_THINK = 3, 4


def test_without_a_reasoning_parser_derender_gets_the_prompt_s_last_ids() -> None:
    prompt = array("i", range(100, 200))
    assert derender_prompt_start(prompt, ()) == 100 - SEED_IDS
    assert derender_prompt_start(array("i", [1, 2]), ()) == 0


def test_derender_gets_the_prompt_from_its_last_reasoning_marker() -> None:
    prompt = array("i", [9, THINK, 9, END_THINK, *([9] * 50)])
    assert derender_prompt_start(prompt, (THINK, END_THINK)) == 3
    # A marker within the last ids changes nothing; none at all leaves the last ids.
    near = array("i", [THINK, *([9] * 50), END_THINK, 9])
    assert derender_prompt_start(near, (THINK, END_THINK)) == len(near) - SEED_IDS
    assert derender_prompt_start(array("i", [9] * 50), (THINK, END_THINK)) == 50 - SEED_IDS


def test_a_marker_s_bytes_across_two_ids_are_not_the_marker() -> None:
    # 768 = 0x300: its bytes hold a 3 (THINK) shifted by one byte.
    prompt = array("i", [768, *([9] * 20)])
    assert derender_prompt_start(prompt, (THINK,)) == 21 - SEED_IDS


def test_with_unknown_markers_derender_gets_the_whole_prompt() -> None:
    assert derender_prompt_start(array("i", [9] * 50), None) == 0


def test_derender_s_chat_request_keeps_the_keys_tools_and_count_of_tool_calls_it_reads() -> None:
    call = {"id": "a", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    request = {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "bash", "description": "d" * 5000}}],
        "chat_template_kwargs": {"enable_thinking": False},
        "messages": [
            {"role": "system", "content": "x" * 10_000},
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "y" * 1000, "tool_calls": [call, call]},
            {"role": "tool", "tool_call_id": "a", "content": "z" * 10_000},
        ],
    }
    slim = derender_chat_request(request)
    assert {k: v for k, v in slim.items() if k not in ("messages", "tools")} == {
        k: v for k, v in request.items() if k not in ("messages", "tools")
    }
    assert slim["tools"] == [{"type": "function", "function": {"name": "bash"}}]
    [assistant, last] = slim["messages"]
    assert assistant["role"] == "assistant"
    assert len(assistant["tool_calls"]) == 2
    assert last == {"role": "user", "content": ""}
    assert len(orjson.dumps(slim)) < 500


def test_a_chunk_s_logprobs_are_left_out_for_a_server_that_does_not_resolve_them() -> None:
    chunk = b'{"request_id":"r","choices":[{"token_ids":[1],"logprobs":{"content":[{"x":1}]}}]}'
    assert orjson.loads(chunk_without_logprobs(chunk))["choices"][0] == {
        "token_ids": [1],
        "logprobs": None,
    }
    plain = b'{"request_id":"r","choices":[{"token_ids":[1],"logprobs":null}]}'
    assert chunk_without_logprobs(plain) is plain


def _event(i: int) -> GenerateEvent:
    data = orjson.dumps({"request_id": "r", "choices": [{"token_ids": [i], "logprobs": None}]})
    return GenerateEvent(data, 1, True)


def test_past_its_budget_the_coalescer_waits_for_the_stream_s_end() -> None:
    c = DerenderCoalescer(min_interval=0.0, budget=100)
    c.add(_event(0))
    assert c.take(1.0) is not None
    c.spend(60)
    c.finished()
    c.add(_event(1))
    assert c.take(2.0) is not None  # 60 < 100: one more call
    c.spend(60)
    c.finished()
    for i in range(2, 6):
        c.add(_event(i))
        assert c.take(3.0 + i) is None  # held: the budget is spent
        assert c.due() is None  # nothing to wait for but the stream's end
    c.close()
    rest = c.take(9.0)
    assert rest is not None
    assert orjson.loads(rest)["choices"][0]["token_ids"] == [2, 3, 4, 5]
    assert c.calls == 3
