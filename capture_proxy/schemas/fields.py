"""Field validation for records: the error that names the field, and the values record schema 2
added to `StagedCallRecord` (span types, their validation, and the defaults that mean
"unknown / not used", which is what a version-1 record holds).

`capture_proxy.schemas.records` re-exports these names; import them from there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import CaptureProxyError

__all__ = [
    "LOGPROBS_MODE_UNKNOWN",
    "V2_DEFAULTS",
    "BridgeSpan",
    "RecordValidationError",
    "WeightSpan",
    "check_spans",
]


class RecordValidationError(CaptureProxyError, ValueError):
    """A value cannot be part of a record; the message names the field (and position)."""

    def __init__(self, field_name: str, message: str, position: int | None = None) -> None:
        where = field_name if position is None else f"{field_name}[{position}]"
        super().__init__(f"{where}: {message}")
        self.field = field_name
        self.position = position


#: ``(version, start, end)``: the engine's weight version that sampled completion tokens
#: ``[start, end)``.
WeightSpan = tuple[str, int, int]
#: ``(start, end, reason)``: prompt tokens ``[start, end)`` that the proxy inserted (not the
#: model, not the environment), and why; a trainer keeps them at loss mask 0.
BridgeSpan = tuple[int, int, str]

#: The logprobs mode when nobody said which one vLLM ran with.
LOGPROBS_MODE_UNKNOWN = "unknown"

#: Fields added by record schema 2, with the value that means "unknown / not used". A version-1
#: record holds exactly these values (its digest does not cover the fields).
V2_DEFAULTS: Mapping[str, Any] = {
    "engine_weight_version": None,
    "weight_spans": (),
    "token_in": False,
    "bridge_spans": (),
    "replica": "",
    "effective_sampling": None,
    "logprobs_mode": LOGPROBS_MODE_UNKNOWN,
}


def _int_at(name: str, value: object, i: int) -> int:
    if type(value) is not int or value < 0:
        raise RecordValidationError(name, f"positions must be non-negative ints, got {value!r}", i)
    return value


def check_spans(
    name: str, values: object, limit: int, label_at: int, what: str
) -> tuple[tuple[Any, ...], ...]:
    """Validate ``[start, end)`` spans (with one string label at `label_at`): in bounds of
    `limit` tokens (`what`), non-empty, in order and not overlapping. Returns them as tuples."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise RecordValidationError(name, f"must be a list of spans, got {values!r:.80}")
    out: list[tuple[Any, ...]] = []
    end_before = 0
    for i, span in enumerate(values):
        if isinstance(span, (str, bytes, Mapping)) or not isinstance(span, Iterable):
            raise RecordValidationError(name, f"a span is a list of 3 values, got {span!r:.80}", i)
        items = tuple(span)
        if len(items) != 3:
            raise RecordValidationError(name, f"a span is a list of 3 values, got {span!r:.80}", i)
        label = items[label_at]
        if not isinstance(label, str) or not label:
            raise RecordValidationError(name, f"needs a non-empty string, got {label!r:.40}", i)
        start, end = (items[1], items[2]) if label_at == 0 else (items[0], items[1])
        start, end = _int_at(name, start, i), _int_at(name, end, i)
        if not start < end <= limit:
            raise RecordValidationError(
                name, f"span [{start}, {end}) is empty or beyond the {limit} {what}", i
            )
        if start < end_before:
            raise RecordValidationError(
                name, f"span [{start}, {end}) starts before the previous one ends ({end_before})", i
            )
        end_before = end
        out.append(items)
    return tuple(out)
