"""Token ids as JSON lists (`adapters/vllm/_ids_json.py`): a prompt's JSON extended by the ids
after it is the JSON of the whole list, whatever the spacing of the JSON it extends."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture_proxy.adapters.vllm import encode_ids, extend_ids_json

ids = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=40)


@given(ids, ids, st.booleans())
def test_an_extended_json_list_decodes_to_the_whole_list(
    head: list[int], more: list[int], spaced: bool
) -> None:
    # vLLM's own JSON may have spaces after the commas and around the brackets.
    head_json = orjson.dumps(head).replace(b",", b", ") + b" " if spaced else encode_ids(head)
    got = extend_ids_json(head_json, more)
    assert orjson.loads(got) == head + more
    if not spaced:
        assert got == encode_ids(head + more)


def test_encoded_ids_from_an_array_are_the_list_s_json() -> None:
    from array import array

    assert encode_ids(array("i", [1, 22, 333])) == b"[1,22,333]"


def test_extending_what_is_not_a_json_list_is_refused() -> None:
    with pytest.raises(ValueError, match="not a JSON list"):
        extend_ids_json(b'{"token_ids": [1]}', [2])
