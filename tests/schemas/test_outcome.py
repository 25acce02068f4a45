"""A rollout's outcome: one finite reward or named finite components, kept in its header."""

from __future__ import annotations

import math
from typing import Any

import pytest

from capture_proxy.schemas.fields import RecordValidationError
from capture_proxy.schemas.outcome import (
    OUTCOME_HISTORY_KEY,
    RolloutOutcome,
    first_non_finite,
    header_metadata,
    split_header_metadata,
)


def test_a_number_is_the_reward_and_an_object_its_components() -> None:
    scalar = RolloutOutcome(reward=1)
    assert (scalar.reward, scalar.scalar_reward, scalar.reward_components) == (1.0, 1.0, None)
    assert isinstance(scalar.reward, float)
    parts = RolloutOutcome(reward={"correct": 1, "format": 0.5})
    assert parts.scalar_reward is None
    assert parts.reward_components == {"correct": 1.0, "format": 0.5}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"reward": math.nan}, "reward"),
        ({"reward": math.inf}, "reward"),
        ({"reward": {"a": 1.0, "b": -math.inf}}, "reward.b"),
        ({"reward": True}, "reward"),
        ({"reward": "1"}, "reward"),
        ({"reward": {}}, "reward"),
        ({"group_id": ""}, "group_id"),
        ({"metadata": {"scores": [1.0, math.nan]}}, "metadata.scores[1]"),
    ],
)
def test_what_cannot_be_an_outcome_is_refused_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(RecordValidationError) as info:
        RolloutOutcome(**kwargs)
    assert info.value.field == field


def test_the_history_travels_in_the_stored_metadata_and_comes_out_again() -> None:
    history = (RolloutOutcome(reward=0.5, at_ms=1), RolloutOutcome(group_id="g", at_ms=2))
    stored = header_metadata({"task": "t"}, history)
    assert set(stored) == {"task", OUTCOME_HISTORY_KEY}
    assert split_header_metadata(stored) == ({"task": "t"}, history)
    # No outcome: the stored metadata is the driver's alone, as before outcomes existed.
    assert header_metadata({"task": "t"}, ()) == {"task": "t"}
    assert split_header_metadata({"task": "t"}) == ({"task": "t"}, ())


def test_a_stored_history_that_is_not_a_list_of_outcomes_is_an_error() -> None:
    with pytest.raises(RecordValidationError, match=OUTCOME_HISTORY_KEY):
        split_header_metadata({OUTCOME_HISTORY_KEY: "oops"})


def test_first_non_finite_names_the_json_path() -> None:
    assert first_non_finite({"a": [1.0, {"b": math.inf}]}) == ("a[1].b", math.inf)
    assert first_non_finite({"a": [1.0, 2, "x", None]}) is None
