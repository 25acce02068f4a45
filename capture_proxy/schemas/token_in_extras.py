"""What a token-in call says about its place in the rollout, kept in the record's extras.

A token-in call builds its prompt from the previous call's exact prompt + completion tokens when
the new request extends that call; when it does not (an edited history, another tool list, ...),
it sends the plain rendering and starts a new segment. Two facts go with the record, in its
`extras` (so `extras_digest` covers them; docs/contract.md describes the shape):

* ``token_in_break``: ``{"reason": str, "detail": str}`` when the call started a new segment,
  and why (``history_edited``, ``tools_changed``, ``template_changed``, ``reply_mismatch``,
  ``template_not_bridgeable``, ``multimodal_append``, ``no_prior``, ...). Absent: it continued.
* ``plain_divergence``: the first prompt position where the plain rendering of the request would
  have differed from the tokens sent (what token-in avoided), or null when it would have been
  the same. Absent: not measured.

`token_in_extras` writes them (the flow merges the result into the record's extras when it
stages the call); `segment_break_of` and `plain_divergence_of` read them back, refusing values
of the wrong shape with `RecordValidationError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .fields import RecordValidationError

__all__ = [
    "BREAK_KEY",
    "DIVERGENCE_KEY",
    "SegmentBreak",
    "plain_divergence_of",
    "segment_break_of",
    "token_in_extras",
]

#: The extras key of a token-in call's segment break.
BREAK_KEY = "token_in_break"
#: The extras key of where the plain rendering would have diverged.
DIVERGENCE_KEY = "plain_divergence"


@dataclass(frozen=True, slots=True)
class SegmentBreak:
    """Why a token-in call started a new segment: a short `reason` (a word such as
    ``history_edited``) and a human `detail` ("" when there is nothing more to say)."""

    reason: str
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "detail": self.detail}


def token_in_extras(
    segment_break: SegmentBreak | None, plain_divergence: int | None
) -> dict[str, Any]:
    """The extras entries of a token-in call: its segment break (None: it continued the
    previous call) and the first position where the plain rendering would have diverged (None:
    it would not have)."""
    if segment_break is not None:
        _check_break(segment_break.to_dict())
    _check_divergence(plain_divergence)
    out: dict[str, Any] = {DIVERGENCE_KEY: plain_divergence}
    if segment_break is not None:
        out[BREAK_KEY] = segment_break.to_dict()
    return out


def segment_break_of(extras: Mapping[str, Any]) -> SegmentBreak | None:
    """The segment break a token-in record's extras name, or None."""
    raw = extras.get(BREAK_KEY)
    if raw is None:
        return None
    _check_break(raw)
    return SegmentBreak(raw["reason"], raw["detail"])


def plain_divergence_of(extras: Mapping[str, Any]) -> tuple[bool, int | None]:
    """``(measured, position)``: whether the record says how the plain rendering compared, and
    the first position where it would have diverged (None: it would have been the same)."""
    if DIVERGENCE_KEY not in extras:
        return False, None
    value = extras[DIVERGENCE_KEY]
    _check_divergence(value)
    return True, value


def _check_break(raw: Any) -> None:
    if (
        not isinstance(raw, dict)
        or set(raw) != {"reason", "detail"}
        or not isinstance(raw["reason"], str)
        or not raw["reason"]
        or not isinstance(raw["detail"], str)
    ):
        raise RecordValidationError(
            f"extras.{BREAK_KEY}",
            f'must be {{"reason": a non-empty string, "detail": a string}}, got {raw!r}',
        )


def _check_divergence(value: Any) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise RecordValidationError(
            f"extras.{DIVERGENCE_KEY}", f"must be a position >= 0 or null, got {value!r}"
        )
