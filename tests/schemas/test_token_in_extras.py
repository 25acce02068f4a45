"""The extras a token-in call carries: its segment break and where the plain rendering would
have diverged; typed on the way in and out, and covered by the extras digest."""

from __future__ import annotations

import re
from array import array
from dataclasses import replace
from typing import Any

import pytest

from capture_proxy.schemas.digest import DigestMismatch, seal_record, verify_record
from capture_proxy.schemas.fields import RecordValidationError
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.schemas.token_in_extras import (
    MediaItem,
    SegmentBreak,
    media_of,
    plain_divergence_of,
    segment_break_of,
    token_in_extras,
)

CAT = MediaItem("image", "c" * 64, 12, 4)
DOG = MediaItem("image", "d" * 64, 30, 4)


def test_a_break_and_a_divergence_round_trip_through_extras() -> None:
    extras = token_in_extras(SegmentBreak("history_edited", "message 3 changed"), 41)
    assert extras == {
        "plain_divergence": 41,
        "token_in_break": {"reason": "history_edited", "detail": "message 3 changed"},
    }
    assert segment_break_of(extras) == SegmentBreak("history_edited", "message 3 changed")
    assert plain_divergence_of(extras) == (True, 41)


def test_a_continued_call_has_no_break_and_none_means_no_divergence() -> None:
    extras = token_in_extras(None, None)
    assert extras == {"plain_divergence": None}
    assert segment_break_of(extras) is None
    assert plain_divergence_of(extras) == (True, None)
    assert plain_divergence_of({}) == (False, None)  # not measured


def test_a_calls_images_round_trip_through_extras_and_none_write_no_key() -> None:
    extras = token_in_extras(None, 7, (CAT, DOG))
    assert extras["token_in_media"] == [
        {"modality": "image", "hash": "c" * 64, "offset": 12, "length": 4},
        {"modality": "image", "hash": "d" * 64, "offset": 30, "length": 4},
    ]
    assert media_of(extras) == (CAT, DOG)
    # A call without images (or with more than the proxy keeps) has no entry: nothing kept.
    assert "token_in_media" not in token_in_extras(None, 7, ())
    assert "token_in_media" not in token_in_extras(None, 7, None)
    assert media_of(token_in_extras(None, 7)) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "extras.token_in_media: must be a non-empty list"),
        ("image", "extras.token_in_media: must be a non-empty list"),
        ([{"modality": "image", "hash": "h", "offset": 0}], "extras.token_in_media[0]: must be"),
        ([{"modality": "", "hash": "h", "offset": 0, "length": 1}], "extras.token_in_media[0]"),
        ([{"modality": "image", "hash": 5, "offset": 0, "length": 1}], "extras.token_in_media[0]"),
        ([{"modality": "image", "hash": "h", "offset": -1, "length": 1}], "[0]"),
        ([{"modality": "image", "hash": "h", "offset": 0, "length": 0}], "[0]"),
        ([{"modality": "image", "hash": "h", "offset": True, "length": 1}], "[0]"),
        # Out of prompt order, or overlapping: not placeholders vLLM would give.
        ([CAT.to_dict(), {**CAT.to_dict(), "offset": 14}], "extras.token_in_media[1]"),
        ([DOG.to_dict(), CAT.to_dict()], "extras.token_in_media[1]"),
    ],
)
def test_recorded_images_of_the_wrong_shape_are_refused_naming_where(
    value: Any, message: str
) -> None:
    with pytest.raises(RecordValidationError, match=re.escape(message)) as caught:
        media_of({"token_in_media": value})
    assert "got " in str(caught.value)  # the message shows the value it refused


def test_writing_images_of_the_wrong_shape_is_refused_too() -> None:
    with pytest.raises(RecordValidationError, match=r"extras\.token_in_media\[1\]"):
        token_in_extras(None, None, (DOG, CAT))


@pytest.mark.parametrize(
    ("extras", "where"),
    [
        ({"token_in_break": {"reason": "", "detail": ""}}, "extras.token_in_break"),
        ({"token_in_break": {"reason": "x"}}, "extras.token_in_break"),
        ({"token_in_break": "history_edited"}, "extras.token_in_break"),
        ({"plain_divergence": -1}, "extras.plain_divergence"),
        ({"plain_divergence": True}, "extras.plain_divergence"),
        ({"plain_divergence": "3"}, "extras.plain_divergence"),
    ],
)
def test_values_of_the_wrong_shape_are_refused_naming_the_key(
    extras: dict[str, Any], where: str
) -> None:
    read = segment_break_of if where.endswith("break") else plain_divergence_of
    with pytest.raises(RecordValidationError, match=re.escape(where)):
        read(extras)


def test_writing_a_bad_value_is_refused_too() -> None:
    with pytest.raises(RecordValidationError, match=r"extras\.plain_divergence"):
        token_in_extras(None, -2)
    with pytest.raises(RecordValidationError, match=r"extras\.token_in_break"):
        token_in_extras(SegmentBreak(""), None)


def test_the_extras_digest_covers_them() -> None:
    record = seal_record(
        StagedCallRecord(
            rollout_id="r",
            call_id="c0",
            seq=0,
            model="m",
            finish_reason="stop",
            request={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            response={"role": "assistant", "content": "ok"},
            prompt_token_ids=array("i", [1, 2]),
            completion_token_ids=array("i", [3]),
            completion_logprobs=array("f", [-0.5]),
            token_in=True,
            extras=token_in_extras(SegmentBreak("tools_changed"), 1, (CAT,)),
        )
    )
    verify_record(record)
    edited = replace(record, extras=token_in_extras(SegmentBreak("tools_changed"), 2, (CAT,)))
    with pytest.raises(DigestMismatch):
        verify_record(edited)
    moved = replace(CAT, offset=13)
    edited = replace(record, extras=token_in_extras(SegmentBreak("tools_changed"), 1, (moved,)))
    with pytest.raises(DigestMismatch):
        verify_record(edited)
