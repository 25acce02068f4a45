"""Control API bodies: one JSON decode, pydantic validation, errors worded as the chat route's.

The chat route validates with msgspec and the control API with pydantic, but a client sees one kind
of refusal from both: status 422 and ``{"error": {"message", "type", "param", "code"}}`` with
``param`` the JSON path of the offending value (``policy.temperature``, ``rollout_id``) and a
message that names that path again, in the same words (`capture_proxy.schemas.request`'s
`RequestValidationError` is the one error both map to). A body that is not JSON is a 400, as on
the chat route.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, TypeVar, get_args

import orjson
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from ..core.policy import POLICY_KEYS
from ..errors import BadRequest, PayloadTooLarge, ProxyError, Unprocessable
from ..schemas.outcome import first_non_finite
from ..schemas.request import (
    RequestValidationError,
    json_type_name,
    not_an_object,
    validate_request,
)

__all__ = [
    "answer_for",
    "check_reward",
    "check_rollout_policy",
    "decode_object",
    "from_pydantic_error",
    "read_body",
]

M = TypeVar("M", bound=BaseModel)

#: pydantic's error type prefixes (``int_type``, ``dict_type``, ...) as msgspec names the types.
_TYPE_NAMES = {
    "string": "str",
    "int": "int",
    "float": "float",
    "bool": "bool",
    "dict": "object",
    "list": "array",
}
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}


def answer_for(error: RequestValidationError) -> ProxyError:
    """The HTTP error for a refused body: the chat route's mapping (422, or 413 when too large)."""
    kind = PayloadTooLarge if error.status == 413 else Unprocessable
    return kind(error.message, code=error.code, param=error.param)


def decode_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (empty is ``{}``): 400 if it is not JSON, 422 if not an object.

    A NaN or an infinity (which Python's ``json.dumps`` writes, and JSON has no word for) is a
    422 naming where it is, like any other value the control API refuses.
    """
    try:
        data = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as e:
        _refuse_non_finite(raw)
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise answer_for(not_an_object(data))
    return data


def _refuse_non_finite(raw: bytes) -> None:
    # orjson refuses NaN, Infinity and numbers past float64 (1e400) as it refuses broken JSON;
    # the standard library reads them as floats, so it can say which value it was. A body it
    # cannot read either (or too deep for it) stays a 400.
    try:
        lenient = json.loads(raw)
    except (ValueError, RecursionError):
        return
    found = first_non_finite(lenient)
    if found is None:
        return
    param, value = found
    shown = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    where = param or "the top level of the request body"
    raise answer_for(
        RequestValidationError(
            param, f"Expected a finite number, got `{shown}` at {where}", "invalid_value"
        )
    )


def check_reward(value: object) -> float | dict[str, float] | None:
    """An outcome's ``reward``: a number or an object of numbers (None: not sent).

    Raises `RequestValidationError` naming ``reward`` or the component (``reward.format``).
    Numbers are finite already: `decode_object` refused the others.
    """
    if value is None:
        return None
    if isinstance(value, dict):
        if not value:
            raise RequestValidationError(
                "reward", "Expected an object with one reward at least at reward", "invalid_value"
            )
        for name, part in value.items():
            if not _is_number(part):
                raise RequestValidationError(
                    f"reward.{name}",
                    f"Expected `float`, got `{json_type_name(part)}` at reward.{name}",
                    "invalid_type",
                )
        return {str(name): float(part) for name, part in value.items()}
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise RequestValidationError(
        "reward",
        f"Expected `float | object | null`, got `{json_type_name(value)}` at reward",
        "invalid_type",
    )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_body(raw: bytes, model: type[M]) -> M:
    """Decode and validate a control API body, or raise the `ProxyError` to answer with.

    Validation is strict, as on the chat route: ``"3"`` is not an int and ``true`` is not 1.
    """
    data = decode_object(raw)
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        raise answer_for(from_pydantic_error(e.errors()[0], model)) from e


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if part == "[key]":  # pydantic's marker for "the key, not the value": JSON keys are str
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _nullable(model: type[BaseModel], name: str) -> bool:
    field = model.model_fields.get(name)
    return field is not None and type(None) in get_args(field.annotation)


def from_pydantic_error(error: ErrorDetails, model: type[BaseModel]) -> RequestValidationError:
    """One pydantic error as the chat route words the same problem (see `from_msgspec_error`)."""
    loc = tuple(error["loc"])
    param = _path(loc)
    where = param or "the top level of the request body"
    kind = error["type"]
    ctx: Mapping[str, Any] = error.get("ctx") or {}
    got = json_type_name(error["input"])
    if kind == "extra_forbidden":
        name = str(loc[-1])
        parent = _path(loc[:-1])
        at = param if parent else "the top level of the request body"
        allowed = f"allowed fields: {', '.join(model.model_fields)}"
        tail = "the control API does not allow it" if parent else allowed
        return RequestValidationError(
            param, f"Unknown field `{name}` at {at}; {tail}", "unknown_field"
        )
    if kind == "missing":
        return RequestValidationError(
            param, f"Missing required field `{loc[-1]}` at {param}", "missing_field"
        )
    if kind.endswith("_type") and kind.removesuffix("_type") in _TYPE_NAMES:
        want = _TYPE_NAMES[kind.removesuffix("_type")]
        if len(loc) == 1 and _nullable(model, str(loc[0])):
            want += " | null"  # as msgspec says it of an optional field
        return RequestValidationError(
            param, f"Expected `{want}`, got `{got}` at {where}", "invalid_type"
        )
    if kind in ("string_too_long", "string_too_short"):
        too_long = kind == "string_too_long"
        bound = f"<= {ctx['max_length']}" if too_long else f">= {ctx['min_length']}"
        return RequestValidationError(
            param, f"Expected `str` of length {bound} at {where}", "invalid_value"
        )
    if kind in _BOUNDS:
        limit = next(iter(ctx.values()))
        return RequestValidationError(
            param, f"Expected `{got}` {_BOUNDS[kind]} {limit} at {where}", "invalid_value"
        )
    return RequestValidationError(param, f"{error['msg']} at {where}", "invalid_value")


def check_rollout_policy(policy: Mapping[str, Any]) -> None:
    """Refuse a rollout's policy naming the JSON path inside the body (``policy.temperature``).

    The capture core checks a policy too, but names only ``policy``: checking here first lets
    the control API answer like the chat route. Raises `RequestValidationError` with code
    ``invalid_policy``.
    """
    for key in policy:
        if key not in POLICY_KEYS:
            allowed = ", ".join(sorted(POLICY_KEYS))
            raise RequestValidationError(
                f"policy.{key}",
                f"Unknown field `{key}` at policy.{key}; a policy may set only: {allowed}",
                "invalid_policy",
            )
    # A policy's values are request parameters: the request schema judges them, on a probe.
    probe = {"model": "policy-check", "messages": [{"role": "user", "content": "x"}], **policy}
    try:
        validate_request(probe)
    except RequestValidationError as e:
        param = f"policy.{e.param}"
        # The schema's message names the path last (`... at temperature`): root it at `policy`.
        head, at, tail = e.message.rpartition(f" {e.param}")
        message = f"{head} {param}{tail}" if at else f"{e.message} (in policy)"
        raise RequestValidationError(param, message, "invalid_policy") from e
