"""What the chat route does that derender does not, sans-IO (`_chat_route`), on vLLM 0.32's
captured answers (tests/fixtures/vllm-0.32.0/token-in/parity-*.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from capture_proxy.adapters.vllm import (
    StopCut,
    StopTokenStrip,
    chat_finish_reason,
    count_reasoning_tokens,
    without_stop_token_id,
)

TOKEN_IN = Path(__file__).parents[1] / "fixtures" / "vllm-0.32.0" / "token-in"


def case(name: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads((TOKEN_IN / f"parity-{name}.json").read_text())
    return value


def events(sse: str) -> list[bytes]:
    return [line[6:].encode() for line in sse.split("\n") if line.startswith("data: {")]


def test_a_streams_last_chunk_goes_without_the_token_it_stopped_on_and_gets_it_back() -> None:
    chunks = events(case("end-of-turn")["generate_stream"])
    last = next(c for c in reversed(chunks) if orjson.loads(c)["choices"])
    strip = StopTokenStrip(include_stop_str=False)
    assert strip.strip(chunks[0]) is chunks[0]  # not the last: as it came
    sent = orjson.loads(strip.strip(last))["choices"][0]
    ids = orjson.loads(last)["choices"][0]["token_ids"]
    assert sent["token_ids"] == ids[:-1]
    answer = {"chunk": {"choices": [{"finish_reason": "stop", "token_ids": ids[:-1]}]}}
    strip.restore(answer)
    assert answer["chunk"]["choices"][0]["token_ids"] == ids
    # With include_stop_str_in_output, the chat route decodes it: nothing is taken out.
    assert StopTokenStrip(include_stop_str=True).strip(last) is last


def test_a_streamed_tool_call_cut_by_length_finishes_with_length() -> None:
    assert chat_finish_reason("tool_calls", "length") == "length"
    assert chat_finish_reason("tool_calls", "stop") == "tool_calls"
    assert chat_finish_reason("stop", "stop") == "stop"


@pytest.mark.parametrize(
    ("request_keys", "text", "want"),
    [
        ({"stop": ["on"]}, "Don", "D"),
        ({"stop": ["on"], "include_stop_str_in_output": True}, "Don", "Don"),
        ({"stop": "on", "min_tokens": 4}, "on and on", "on and "),
        ({"stop": ["xyz", "on"]}, "Done", "D"),
    ],
)
def test_a_stop_string_cuts_as_the_chat_route_does(
    request_keys: dict[str, Any], text: str, want: str
) -> None:
    real = case("stop-string")
    assert real["derender_response"]["choices"][0]["message"]["content"] == "Don"
    assert real["chat_response"]["choices"][0]["message"]["content"] == "D"
    stop = StopCut.of(request_keys)
    assert stop is not None
    message: dict[str, Any] = {"content": text, "reasoning": None}
    stop.cut_message(message, "on")
    assert message["content"] == want
    assert StopCut.of({"stop": []}) is None


def test_a_stop_token_id_is_taken_out_of_a_unary_answer() -> None:
    answer = {"choices": [{"finish_reason": "stop", "stop_reason": 207, "token_ids": [5, 207]}]}
    sent, only = without_stop_token_id(orjson.dumps(answer), include_stop_str=False)
    assert (orjson.loads(sent)["choices"][0]["token_ids"], only) == ([5], False)
    alone = {"choices": [{"finish_reason": "stop", "stop_reason": 207, "token_ids": [207]}]}
    raw = orjson.dumps(alone)
    assert without_stop_token_id(raw, include_stop_str=False) == (raw, True)
    # An end of sequence (null) or a stop string stays: the unary derender handles those.
    for reason in (None, "on"):
        raw = orjson.dumps({"choices": [{"stop_reason": reason, "token_ids": [5, 2]}]})
        assert without_stop_token_id(raw, include_stop_str=False) == (raw, False)


def test_reasoning_tokens_are_counted_as_the_qwen3_parser_counts() -> None:
    think = (3, 4, 5)
    assert count_reasoning_tokens([207] * 12, think, open_at_start=True) == 12
    assert count_reasoning_tokens([4, 9, 9], think, open_at_start=True) == 0
    assert count_reasoning_tokens([3, 9, 9, 4, 9, 3, 9], think, open_at_start=True) == 2
    # Thinking off: the parser never enters reasoning, a sampled `<think>` included.
    assert count_reasoning_tokens([3, 9, 9, 4, 9], think, open_at_start=False) == 0
    assert count_reasoning_tokens([9, 9], think, open_at_start=False) == 0
    # A tool call ends the reasoning as `</think>` does (vLLM's Qwen3 parser).
    assert count_reasoning_tokens([9, 5, 9, 9, 6], think, open_at_start=True) == 1
    assert count_reasoning_tokens([9, 5, 9], (3, 4, None), open_at_start=True) == 3
