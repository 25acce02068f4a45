"""What a token-in call says about its place in the rollout, kept in the record's extras.

A token-in call builds its prompt from the previous call's exact prompt + completion tokens when
the new request extends that call; when it does not (an edited history, another tool list, ...),
it sends the plain rendering and starts a new segment. Two facts go with the record, in its
`extras` (so `extras_digest` covers them; docs/contract.md describes the shape):

* ``token_in_break``: ``{"reason": str, "detail": str}`` when the call started a new segment,
  and why (``history_edited``, ``tools_changed``, ``template_changed``, ``reply_mismatch``,
  ``template_not_bridgeable``, ``multimodal_append``, ``no_prior``, ``tokenizer_changed``,
  ``stopped_on_other_token``, ...). Absent: it continued.
* ``plain_divergence``: the first prompt position where the plain rendering of the request would
  have differed from the tokens sent (what token-in avoided), or null when it would have been
  the same. Absent: not measured.
* ``token_in_media``: the prompt's images as the next call's bridge needs them, in prompt order:
  ``[{"modality": str, "hash": str, "offset": int, "length": int}, ...]`` (vLLM's item hash and
  its placeholder tokens ``[offset, offset + length)`` in the record's prompt). Only a call with
  images has it, and only when they fit the proxy's bound; without it, a call read back from the
  store (a restarted proxy) cannot be continued by one whose history has images.

`token_in_extras` writes them (the flow merges the result into the record's extras when it
stages the call); `segment_break_of`, `plain_divergence_of` and `media_of` read them back,
refusing values of the wrong shape with `RecordValidationError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .fields import RecordValidationError

__all__ = [
    "BESIDE_KEY",
    "BREAK_KEY",
    "DIVERGENCE_KEY",
    "MEDIA_KEY",
    "MediaItem",
    "SegmentBreak",
    "beside_aborted_of",
    "media_of",
    "plain_divergence_of",
    "segment_break_of",
    "token_in_extras",
]

#: The extras key of a token-in call's segment break.
BREAK_KEY = "token_in_break"
#: The extras key of a generation sent beside the request's render and aborted.
BESIDE_KEY = "token_in_beside_aborted"
#: The extras key of where the plain rendering would have diverged.
DIVERGENCE_KEY = "plain_divergence"
#: The extras key of the prompt's image placeholders.
MEDIA_KEY = "token_in_media"


@dataclass(frozen=True, slots=True)
class SegmentBreak:
    """Why a token-in call started a new segment: a short `reason` (a word such as
    ``history_edited``) and a human `detail` ("" when there is nothing more to say)."""

    reason: str
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One multimodal item of a prompt (an image), as vLLM's render places it: its modality,
    its hash (``features.mm_hashes``) and its placeholder tokens ``[offset, offset + length)``
    (``features.mm_placeholders``). Its processed data is not kept: every render of a
    conversation carries every item's."""

    modality: str
    hash: str
    offset: int
    length: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "modality": self.modality,
            "hash": self.hash,
            "offset": self.offset,
            "length": self.length,
        }


def token_in_extras(
    segment_break: SegmentBreak | None,
    plain_divergence: int | None,
    media: Sequence[MediaItem] | None = None,
    beside_aborted: SegmentBreak | None = None,
) -> dict[str, Any]:
    """The extras entries of a token-in call: its segment break (None: it continued the
    previous call), the first position where the plain rendering would have diverged (None:
    it would not have), and its prompt's images (`media`, in prompt order; none or None: no
    entry, as for a call without images or with more than the proxy keeps), and why a
    generation sent beside the request's render was aborted (None: none was)."""
    if segment_break is not None:
        _check_break(segment_break.to_dict())
    if beside_aborted is not None:
        _check_break(beside_aborted.to_dict(), BESIDE_KEY)
    _check_divergence(plain_divergence)
    out: dict[str, Any] = {DIVERGENCE_KEY: plain_divergence}
    if segment_break is not None:
        out[BREAK_KEY] = segment_break.to_dict()
    if media:
        recorded = [m.to_dict() for m in media]
        _check_media(recorded)
        out[MEDIA_KEY] = recorded
    if beside_aborted is not None:
        out[BESIDE_KEY] = beside_aborted.to_dict()
    return out


def beside_aborted_of(extras: Mapping[str, Any]) -> SegmentBreak | None:
    """Why a token-in record's generation sent beside its render was aborted, or None."""
    raw = extras.get(BESIDE_KEY)
    if raw is None:
        return None
    _check_break(raw, BESIDE_KEY)
    return SegmentBreak(raw["reason"], raw["detail"])


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


def media_of(extras: Mapping[str, Any]) -> tuple[MediaItem, ...] | None:
    """The prompt's images a token-in record's extras keep, in prompt order; None when they
    keep none (a call without images, one with more than the proxy keeps, or a record written
    before records kept them)."""
    raw = extras.get(MEDIA_KEY)
    if raw is None:
        return None
    _check_media(raw)
    return tuple(MediaItem(m["modality"], m["hash"], m["offset"], m["length"]) for m in raw)


def _check_break(raw: Any, key: str = BREAK_KEY) -> None:
    if (
        not isinstance(raw, dict)
        or set(raw) != {"reason", "detail"}
        or not isinstance(raw["reason"], str)
        or not raw["reason"]
        or not isinstance(raw["detail"], str)
    ):
        raise RecordValidationError(
            f"extras.{key}",
            f'must be {{"reason": a non-empty string, "detail": a string}}, got {raw!r}',
        )


def _check_divergence(value: Any) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise RecordValidationError(
            f"extras.{DIVERGENCE_KEY}", f"must be a position >= 0 or null, got {value!r}"
        )


_MEDIA_SHAPE = (
    'must be a non-empty list of {"modality": a non-empty string, "hash": a non-empty string, '
    '"offset": a position >= 0, "length": an int >= 1}, in prompt order without overlaps'
)


def _check_media(raw: Any) -> None:
    where = f"extras.{MEDIA_KEY}"
    if not isinstance(raw, list) or not raw:
        raise RecordValidationError(where, f"{_MEDIA_SHAPE}, got {raw!r:.200}")
    end = 0
    for i, item in enumerate(raw):
        if (
            not isinstance(item, dict)
            or set(item) != {"modality", "hash", "offset", "length"}
            or not isinstance(item["modality"], str)
            or not item["modality"]
            or not isinstance(item["hash"], str)
            or not item["hash"]
            or type(item["offset"]) is not int
            or type(item["length"]) is not int
            or item["offset"] < end
            or item["length"] < 1
        ):
            raise RecordValidationError(where, f"{_MEDIA_SHAPE}, got {item!r:.200}", i)
        end = item["offset"] + item["length"]
