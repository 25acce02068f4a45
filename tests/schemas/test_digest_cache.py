"""RequestValueCache: sealing with it gives the very digest sealing without it gives."""

from __future__ import annotations

import math
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.schemas.digest import (
    EncodingError,
    RequestValueCache,
    encode_request,
    encode_value,
    record_digest,
    seal_record,
)
from capture_proxy.schemas.records import StagedCallRecord

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool{i}",
            "description": "Runs a thing. " * 20,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": ["string", "null"], "minLength": 1}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    }
    for i in range(4)
]


def record(tools: Any, seq: int = 0) -> StagedCallRecord:
    return StagedCallRecord(
        rollout_id="r1",
        call_id=f"c{seq}",
        seq=seq,
        model="m",
        finish_reason="stop",
        request={
            "messages": [{"role": "user", "content": f"turn {seq}"}],
            "tools": tools,
            "tool_choice": "auto",
            "temperature": 0.5,
        },
        response={"role": "assistant", "content": "ok"},
        prompt_token_ids=array("i", [1, 2, 3]),
        completion_token_ids=array("i", [4]),
        completion_logprobs=array("f", [-0.5]),
    )


def test_sealing_with_the_cache_gives_the_same_digests() -> None:
    cache = RequestValueCache()
    for seq in range(3):  # the second and third seal hit the cache
        r = record(TOOLS, seq)
        assert seal_record(r, encoder=cache).digest == seal_record(r).digest
    assert len(cache._encodings) == 1


def test_a_value_that_could_hide_a_nan_is_never_served_from_the_cache() -> None:
    # orjson writes NaN as null: a tool set with a null token is encoded every time, so a NaN
    # in place of that null is still refused as the encoder refuses it.
    cache = RequestValueCache(min_bytes=0)
    with_null = [{**TOOLS[0], "x": None}]
    assert cache(with_null, "request.tools") == encode_value(with_null)
    with_nan = [{**TOOLS[0], "x": math.nan}]
    with pytest.raises(EncodingError, match=r"request\.tools\[0\]\.x"):
        record_digest(record(with_nan), encoder=cache)
    assert not cache._encodings


def test_refusals_name_the_same_path_with_and_without_the_cache() -> None:
    cache = RequestValueCache(min_bytes=0)
    for bad in ([{"n": 2**63}], [{"s": "\ud800"}], [{1: "non-string key"}]):
        with pytest.raises(EncodingError) as plain:
            record_digest(record(bad))
        with pytest.raises(EncodingError) as cached:
            record_digest(record(bad), encoder=cache)
        assert str(cached.value) == str(plain.value)


def test_cache_is_bounded() -> None:
    cache = RequestValueCache(max_entries=2, min_bytes=0)
    for i in range(5):
        cache([{"tool": i}], "request.tools")
    assert len(cache._encodings) == 2


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_JSON, min_size=1, max_size=4))
def test_cached_encoding_equals_the_encoder_or_refuses_alike(values: list[Any]) -> None:
    cache = RequestValueCache(min_bytes=0, max_entries=3)
    for value in [*values, *values]:  # every value twice: the second time may be a hit
        try:
            want: bytes | str = encode_value(value, field="request.x")
        except EncodingError as e:
            want = str(e)
        try:
            got: bytes | str = cache(value, "request.x")
        except EncodingError as e:
            got = str(e)
        assert got == want


def test_a_request_part_computed_ahead_gives_the_same_digest() -> None:
    cache = RequestValueCache()
    for seq in range(2):
        r = record(TOOLS, seq)
        part = encode_request(r.request, encoder=cache)
        assert part == encode_request(r.request)
        assert seal_record(r, request_part=part).digest == seal_record(r).digest
        assert record_digest(r, request_part=part) == record_digest(r)


def test_a_request_that_cannot_be_encoded_is_refused_ahead_as_when_sealing() -> None:
    bad = record([{**TOOLS[0], "x": math.nan}])
    with pytest.raises(EncodingError, match=r"request\.tools\[0\]\.x") as ahead:
        encode_request(bad.request)
    with pytest.raises(EncodingError) as sealing:
        seal_record(bad)
    assert str(ahead.value) == str(sealing.value)
