"""Prompt ids decoded against a session's cached prefix: always the same ids as a full decode."""

from __future__ import annotations

import json
from array import array

import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.adapters.vllm import CaptureExtractionError, VLLMAdapter
from capture_proxy.adapters.vllm._ids import (
    Prefix,
    PrefixCache,
    common_prefix_len,
    decode_prompt,
)

IDS = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=60)


def cached(prompt: list[int], completion: list[int]) -> Prefix:
    """What the cache holds after a call with this prompt and completion (compact JSON)."""
    cache = PrefixCache()
    cache.put("s", orjson.dumps(prompt), array("i", prompt), array("i", completion))
    entry = cache.get("s")
    assert entry is not None
    return entry


def test_common_prefix_len_across_blocks() -> None:
    a = bytes(range(256)) * 40
    assert common_prefix_len(a, a) == len(a)
    assert common_prefix_len(a, a[:5000]) == 5000
    for at in (0, 1, 4095, 4096, 4097, 9000, len(a) - 1):
        b = a[:at] + b"\xff" + a[at + 1 :] if a[at] != 0xFF else a[:at] + b"\x00" + a[at + 1 :]
        assert common_prefix_len(a, b) == at
    assert common_prefix_len(b"", a) == 0


@settings(max_examples=400, deadline=None)
@given(
    previous=IDS,
    completion=IDS,
    new=IDS,
    keep=st.integers(min_value=0, max_value=130),
    spaced=st.booleans(),
)
def test_any_prompt_decodes_to_the_full_decode(
    previous: list[int], completion: list[int], new: list[int], keep: int, spaced: bool
) -> None:
    # The new prompt extends (a prefix of) the previous prompt + completion, drifting anywhere.
    full = previous + completion
    prompt = full[: min(keep, len(full))] + new
    raw = json.dumps(prompt).encode() if spaced else orjson.dumps(prompt)
    got = decode_prompt("prompt_token_ids", raw, cached(previous, completion))
    assert got == array("i", prompt)
    assert got is not None
    assert got.typecode == "i"


def test_a_session_turn_reuses_the_cached_ids() -> None:
    previous, completion = list(range(1000, 3000)), [7, 8, 9]
    prefix = cached(previous, completion)
    raw = orjson.dumps([*previous, *completion, 42, 43])
    assert raw.startswith(prefix.text)
    assert decode_prompt("p", raw, prefix) == array("i", [*previous, *completion, 42, 43])
    # Token boundaries: a cached 12 is not the new 123.
    prefix = cached([5, 12], [])
    assert decode_prompt("p", b"[5,123,4]", prefix) == array("i", [5, 123, 4])
    assert decode_prompt("p", b"[5,12]", prefix) == array("i", [5, 12])
    assert decode_prompt("p", b"[5]", prefix) == array("i", [5])
    assert decode_prompt("p", b"null", prefix) is None


@pytest.mark.parametrize(
    "raw",
    [b"[5,12,", b"[5,12,true]", b"[5,12,1.5]", b'[5,12,"7"]', b"[5,12]x", b"[5,12,]", b"[5"],
)
def test_malformed_tails_are_refused_as_a_full_decode_would(raw: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_prompt("p", raw, None)
    with pytest.raises(msgspec.DecodeError):
        decode_prompt("p", raw, cached([5, 12], [3]))


def test_an_id_beyond_int32_is_refused_with_or_without_prefix() -> None:
    for prefix in (None, cached([5, 12], [])):
        with pytest.raises(CaptureExtractionError) as info:
            decode_prompt("prompt_token_ids", b"[5,12,%d]" % 2**31, prefix)
        assert info.value.reason == "invalid_token_ids"


def test_cache_is_bounded_and_least_recently_used_goes_first() -> None:
    prompt = array("i", range(100))
    raw = orjson.dumps(list(prompt))
    size = cached(list(prompt), [1, 2]).size
    cache = PrefixCache(max_bytes=4 * size + 10)
    for s in "abcd":
        cache.put(s, raw, prompt, array("i", [1, 2]))
    assert cache.get("a") is not None  # "a" is now the most recently used
    cache.put("e", raw, prompt, array("i", [1, 2]))
    assert cache.get("b") is None
    assert {s for s in "acde" if cache.get(s) is not None} == set("acde")
    assert cache.bytes <= cache.max_bytes
    # Replacing a session's entry does not count it twice; no session, no entry.
    cache.put("a", raw, prompt, array("i", [1, 2]))
    assert cache.bytes == 4 * size
    cache.put(None, raw, prompt, array("i"))
    assert len(cache) == 4
    # An entry larger than a quarter of the budget is not kept (it would evict everyone).
    small = PrefixCache(max_bytes=size)
    small.put("x", raw, prompt, array("i", [1, 2]))
    assert small.get("x") is None


def test_adapter_sessions_give_the_ids_of_a_sessionless_parse() -> None:
    adapter = VLLMAdapter()
    plan = adapter.plan({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    prompt: list[int] = [11, 12, 13]
    for turn in range(4):
        completion = [100 + turn, 200 + turn]
        body = orjson.dumps(
            {
                "id": f"c{turn}",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "x"},
                        "logprobs": {
                            "content": [
                                {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
                            ]
                            * 2
                        },
                        "finish_reason": "stop",
                        "token_ids": completion,
                    }
                ],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": 2},
                "prompt_token_ids": prompt,
            }
        )
        with_session, client = adapter.parse_response(body, plan, session="r1")
        without, client_plain = VLLMAdapter().parse_response(body, plan)
        assert with_session == without
        assert client == client_plain
        assert with_session.prompt_token_ids == array("i", prompt)
        # The next turn re-sends this one, then a tool result; turn 2 drifts inside it.
        prompt = prompt + completion + [turn]
        if turn == 2:
            prompt[-2] = 999
    entry = adapter.prefixes.get("r1")
    assert entry is not None
    assert entry.text == orjson.dumps(list(entry.ids))[:-1]
