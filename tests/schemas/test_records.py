"""Record validation says which field and which position is wrong; token data survives the
storage codec bit for bit (property tests)."""

from __future__ import annotations

import math
import re
import struct
from array import array
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture_proxy.schemas.digest import seal_record, verify_record
from capture_proxy.schemas.records import RecordValidationError, StagedCallRecord
from capture_proxy.sinks.codec import decode_row, encode_record


def make(**overrides: Any) -> StagedCallRecord:
    fields: dict[str, Any] = {
        "rollout_id": "r1",
        "call_id": "c1",
        "seq": 0,
        "model": "m",
        "finish_reason": "stop",
        "request": {"messages": [{"role": "user", "content": "hi"}]},
        "response": {"role": "assistant", "content": "ok"},
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [4, 5],
        "completion_logprobs": [-0.1, -0.2],
    }
    fields.update(overrides)
    return StagedCallRecord(**fields)


token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=1, max_size=64)
logprob_values = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=32)


@given(token_lists, st.data())
def test_negative_token_id_named_with_its_position(ids: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=0, max_value=len(ids) - 1))
    ids[k] = data.draw(st.integers(min_value=-(2**31), max_value=-1))
    with pytest.raises(RecordValidationError) as info:
        make(prompt_token_ids=ids)
    assert (info.value.field, info.value.position) == ("prompt_token_ids", k)
    assert str(info.value).startswith(f"prompt_token_ids[{k}]: token id must be >= 0")


@given(token_lists, st.data())
def test_out_of_range_or_non_int_token_id_named(ids: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=0, max_value=len(ids) - 1))
    mixed: list[object] = list(ids)
    mixed[k] = data.draw(st.sampled_from([2**31, 2**40, 1.5, "7", None]))
    lps = [-1.0] * len(ids)
    with pytest.raises(RecordValidationError) as info:
        make(completion_token_ids=mixed, completion_logprobs=lps)
    assert info.value.field == "completion_token_ids"
    assert info.value.position == k
    assert f"completion_token_ids[{k}]" in str(info.value)


def test_bool_token_id_is_refused() -> None:
    with pytest.raises(RecordValidationError, match=r"prompt_token_ids\[1\]"):
        make(prompt_token_ids=[1, True, 3])


@given(
    st.lists(logprob_values, min_size=1, max_size=64),
    st.data(),
)
def test_bad_logprob_named_with_its_position(lps: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=0, max_value=len(lps) - 1))
    bad = data.draw(
        st.sampled_from([math.nan, math.inf, -math.inf])
        | st.floats(min_value=2.0**-20, max_value=2.0**100, width=32)
    )
    lps[k] = bad
    ids = list(range(len(lps)))
    with pytest.raises(RecordValidationError) as info:
        make(completion_token_ids=ids, completion_logprobs=lps)
    assert (info.value.field, info.value.position) == ("completion_logprobs", k)
    expected = "must be finite" if not math.isfinite(bad) else "must be <= 0"
    assert expected in str(info.value)


@given(st.integers(min_value=0, max_value=20), st.integers(min_value=0, max_value=20))
def test_logprob_count_mismatch(n_tokens: int, n_logprobs: int) -> None:
    ids, lps = list(range(n_tokens)), [-1.0] * n_logprobs
    if n_tokens == n_logprobs:
        make(completion_token_ids=ids, completion_logprobs=lps)
        return
    with pytest.raises(RecordValidationError) as info:
        make(completion_token_ids=ids, completion_logprobs=lps)
    assert info.value.field == "completion_logprobs"
    assert f"{n_logprobs} logprobs for {n_tokens} tokens" in str(info.value)


@pytest.mark.parametrize("field", ["rollout_id", "call_id", "parent_call_id", "retry_of"])
@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "a/b", "ünï", 7])
def test_bad_ids_named(field: str, bad: object) -> None:
    with pytest.raises(RecordValidationError) as info:
        make(**{field: bad})
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: must be 1-128 characters")


@given(st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True))
def test_good_ids_accepted(value: str) -> None:
    assert make(rollout_id=value, call_id=value, parent_call_id=value).call_id == value


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"seq": -1}, "seq"),
        ({"seq": True}, "seq"),
        ({"weight_version": 1.0}, "weight_version"),
        ({"model": ""}, "model"),
        ({"finish_reason": None}, "finish_reason"),
        ({"request": [1]}, "request"),
        ({"extras": None}, "extras"),
        ({"schema_version": 99}, "schema_version"),
        ({"schema_version": 0}, "schema_version"),
        ({"engine_weight_version": ""}, "engine_weight_version"),
        ({"engine_weight_version": 3}, "engine_weight_version"),
        ({"weight_spans": "v1"}, "weight_spans"),
        ({"weight_spans": [("v1", 0)]}, "weight_spans"),
        ({"weight_spans": [(1, 0, 1)]}, "weight_spans"),
        ({"weight_spans": [("v1", 0, 3)]}, "weight_spans"),  # 2 completion tokens
        ({"weight_spans": [("v1", 1, 1)]}, "weight_spans"),
        ({"weight_spans": [("v1", 0, 2), ("v2", 1, 2)]}, "weight_spans"),
        ({"weight_spans": [("v1", -1, 1)]}, "weight_spans"),
        ({"token_in": 1}, "token_in"),
        ({"bridge_spans": [(0, 4, "eot")]}, "bridge_spans"),  # 3 prompt tokens
        ({"bridge_spans": [(0, 1, "")]}, "bridge_spans"),
        ({"bridge_spans": {"a": 1}}, "bridge_spans"),
        ({"replica": None}, "replica"),
        ({"effective_sampling": [1]}, "effective_sampling"),
        ({"logprobs_mode": ""}, "logprobs_mode"),
        ({"logprobs_mode": None}, "logprobs_mode"),
        ({"schema_version": 1, "token_in": True}, "token_in"),
    ],
)
def test_other_fields_named(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(RecordValidationError) as info:
        make(**overrides)
    assert info.value.field == field
    # A span list names the bad span's position too: "weight_spans[1]: ...".
    assert re.match(rf"{field}(\[\d+\])?: ", str(info.value))


def test_version_2_fields_default_to_unknown_and_spans_become_tuples() -> None:
    r = make()
    assert r.schema_version == 2
    assert r.digest_version == 2
    assert (r.engine_weight_version, r.weight_spans, r.token_in, r.bridge_spans) == (
        None,
        (),
        False,
        (),
    )
    assert (r.replica, r.effective_sampling, r.logprobs_mode) == ("", None, "unknown")
    spans = make(weight_spans=[["v1", 0, 1], ["v2", 1, 2]], bridge_spans=[[0, 1, "eot"]])
    assert spans.weight_spans == (("v1", 0, 1), ("v2", 1, 2))
    assert spans.bridge_spans == ((0, 1, "eot"),)
    assert make(schema_version=1).digest_version == 1


# -- token arrays through the storage codec ---------------------------------------------------


@given(
    parent=token_lists,
    keep=st.integers(min_value=0, max_value=64),
    new=st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=64),
    split=st.integers(min_value=0, max_value=128),
    lps=st.lists(logprob_values, max_size=128),
    with_parent=st.booleans(),
)
def test_token_arrays_round_trip_through_the_codec(
    parent: list[int], keep: int, new: list[int], split: int, lps: list[float], with_parent: bool
) -> None:
    full = parent[: min(keep, len(parent))] + new
    if not full:
        full = [0]
    cut = max(1, min(split, len(full)))  # the prompt is never empty
    completion = full[cut:]
    logprobs = (lps + [-0.5] * len(completion))[: len(completion)]
    record = seal_record(
        make(
            prompt_token_ids=full[:cut],
            completion_token_ids=completion,
            completion_logprobs=logprobs,
            parent_call_id="p1" if with_parent else None,
        )
    )
    parent_full = array("i", parent) if with_parent else None
    encoded = encode_record(record, parent_full)
    row = encoded.row
    assert row["prev_len"] + row["delta_len"] == row["cum_len"] == len(full)
    assert len(row["delta_tokens"]) == 4 * row["delta_len"]  # only the new tokens are stored
    decoded, rebuilt = decode_row(row, encoded.blobs.__getitem__, parent_full)
    assert rebuilt == array("i", full)
    assert decoded.prompt_token_ids == record.prompt_token_ids
    assert decoded.completion_token_ids == record.completion_token_ids
    # float32 bit patterns, not just values: -0.0 stays -0.0.
    assert decoded.completion_logprobs.tobytes() == record.completion_logprobs.tobytes()
    verify_record(decoded)


def test_negative_zero_logprob_keeps_its_bits() -> None:
    record = seal_record(make(completion_logprobs=[-0.0, -0.0]))
    encoded = encode_record(record, None)
    decoded, _ = decode_row(encoded.row, encoded.blobs.__getitem__, None)
    assert [struct.pack("<f", v) for v in decoded.completion_logprobs] == [b"\x00\x00\x00\x80"] * 2
    verify_record(decoded)
