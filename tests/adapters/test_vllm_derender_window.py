"""What a derender call resends (`derender_prompt_start`, `derender_chat_request`,
`derender_generate_answer`), and the coalescer's byte budget (`DerenderCoalescer`), sans-IO.
That vLLM answers the same for them is shown against the real vLLM by
tests/e2e/test_vllm_parity.py."""

from __future__ import annotations

from array import array

import orjson

from capture_proxy.adapters.vllm import (
    SEED_IDS,
    DerenderCoalescer,
    derender_chat_request,
    derender_chunk_body,
    derender_generate_answer,
    derender_prompt_start,
    derender_tail,
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
        "temperature": 0,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 0,
        "tools": [{"type": "function", "function": {"name": "bash", "description": "d" * 5000}}],
        "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": False},
        "return_token_ids": True,
        "messages": [
            {"role": "system", "content": "x" * 10_000},
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "y" * 1000, "tool_calls": [call, call]},
            {"role": "tool", "tool_call_id": "a", "content": "z" * 10_000},
        ],
    }
    slim = derender_chat_request(request)
    # What only a generation reads goes: sampling, logprobs (derender resolves the entries it
    # gets), the model (the derender request's own, not the chat request's, names it).
    assert {k: v for k, v in slim.items() if k not in ("messages", "tools")} == {
        "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": False},
        "return_token_ids": True,
    }
    assert slim["tools"] == [{"function": {"name": "bash"}}]
    [assistant] = slim["messages"]
    assert assistant["role"] == "assistant"
    assert len(assistant["tool_calls"]) == 2
    assert len(orjson.dumps(slim)) < 400
    assert derender_chat_request({"messages": [user := {"role": "user", "content": "hi"}]}) == {
        "messages": []
    }
    # Token ids the client did not ask for: its answer's come from generate when it does.
    assert "return_token_ids" not in derender_chat_request(request, token_ids=False)
    assert user == {"role": "user", "content": "hi"}


def test_derender_s_tools_keep_their_parameters_without_their_descriptions() -> None:
    parameters = {
        "type": "object",
        "description": "what the tool takes",
        "properties": {
            # A property named "description" is a name, not an annotation.
            "description": {"type": "string", "description": "the text"},
            "mode": {"enum": ["a", "b"], "default": "a", "description": "how"},
            "items": {"type": "array", "items": {"type": "integer", "description": "an id"}},
            "either": {"anyOf": [{"type": "string", "description": "s"}, {"type": "null"}]},
        },
        "required": ["description"],
        "$defs": {"x": {"type": "string", "description": "a def"}},
    }
    tool = {
        "type": "function",
        "function": {"name": "t", "description": "d", "parameters": parameters, "strict": True},
    }
    [slim] = derender_chat_request({"messages": [], "tools": [tool]})["tools"]
    assert slim == {
        "function": {
            "name": "t",
            "parameters": {
                "type": "object",
                "properties": {
                    "description": {"type": "string"},
                    "mode": {"enum": ["a", "b"], "default": "a"},
                    "items": {"type": "array", "items": {"type": "integer"}},
                    "either": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                },
                "required": ["description"],
                "$defs": {"x": {"type": "string"}},
            },
            "strict": True,
        }
    }
    # A tool of another type is sent as it is.
    other = {"type": "custom", "custom": {"name": "c", "description": "d"}}
    assert derender_chat_request({"messages": [], "tools": [other]})["tools"] == [other]


GENERATE_ANSWER = orjson.dumps(
    {
        "request_id": "generate-tokens-r",
        "model": "policy",
        "created": 1,
        "usage": {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2},
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": [7, 8],
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": [{"version": "v", "start": 0, "end": 2}],
                "logprobs": {"content": [{"token_id": 7, "logprob": -0.5, "rank": 1}]},
            }
        ],
    }
)


def test_derender_gets_generate_s_answer_without_what_it_does_not_read() -> None:
    unary = orjson.loads(derender_generate_answer(GENERATE_ANSWER, logprobs=False, unary=True))
    assert unary == {
        "request_id": "generate-tokens-r",
        "choices": [{"index": 0, "finish_reason": "length", "token_ids": [7, 8]}],
    }
    # Streamed, derender reads the usage (its usage chunk); logprobs go when the client gets them.
    chunk = orjson.loads(derender_generate_answer(GENERATE_ANSWER, logprobs=True))
    assert chunk["usage"] == {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2}
    assert chunk["choices"][0]["logprobs"] == {
        "content": [{"token_id": 7, "logprob": -0.5, "rank": 1}]
    }
    assert "model" in chunk
    assert "output_mode" not in chunk
    assert "weight_versions" not in chunk["choices"][0]
    # Not generate's answer: sent as it is, for derender to say what is wrong with it.
    assert derender_generate_answer(b"[1]", logprobs=False) == b"[1]"
    assert derender_generate_answer(b"{oops", logprobs=False) == b"{oops"


def test_a_chunk_s_logprobs_are_left_out_for_a_server_that_does_not_resolve_them() -> None:
    chunk = b'{"request_id":"r","choices":[{"token_ids":[1],"logprobs":{"content":[{"x":1}]}}]}'
    assert orjson.loads(derender_generate_answer(chunk, logprobs=False))["choices"][0] == {
        "token_ids": [1]
    }


def _event(i: int) -> GenerateEvent:
    data = orjson.dumps({"request_id": "r", "choices": [{"token_ids": [i], "logprobs": None}]})
    return GenerateEvent(data, 1, True)


def test_past_its_budget_the_coalescer_waits_for_the_stream_s_end() -> None:
    c = DerenderCoalescer(min_interval=0.0, budget=230, call_bytes=40)
    c.add(_event(0))
    assert c.take(1.0) is not None  # 0 + 2 * 40 <= 250
    c.spend(60)
    c.finished()
    c.add(_event(1))
    assert c.take(2.0) is not None  # 60 + 2 * 60 <= 230: one more call, and room for the last
    c.spend(60)
    c.finished()
    for i in range(2, 6):
        c.add(_event(i))
        assert c.take(3.0 + i) is None  # held: 120 + 2 * 60 leaves no room for a last call
        assert c.due() is None  # nothing to wait for but the stream's end
    c.close()
    rest = c.take(9.0)
    assert rest is not None
    assert orjson.loads(rest)["choices"][0]["token_ids"] == [2, 3, 4, 5]
    assert c.calls == 3


def test_a_budget_without_room_for_two_calls_derenders_the_stream_once_at_its_end() -> None:
    c = DerenderCoalescer(min_interval=0.0, budget=100, call_bytes=60)
    for i in range(3):
        c.add(_event(i))
        assert c.take(float(i)) is None
    c.close()
    rest = c.take(9.0)
    assert rest is not None
    assert orjson.loads(rest)["choices"][0]["token_ids"] == [0, 1, 2]
    assert c.calls == 1


def test_a_stream_s_first_derender_call_leaves_its_null_state_unsaid() -> None:
    tail = derender_tail([5, 6], {"messages": []})
    first = orjson.loads(derender_chunk_body(b'{"choices":[]}', None, tail))
    assert "stream_state" not in first  # vLLM 0.32's default: None
    state = {"output_token_ids": [9]}
    later = orjson.loads(derender_chunk_body(b'{"choices":[]}', state, tail))
    assert later["stream_state"] == state
    assert {k: v for k, v in later.items() if k != "stream_state"} == first
