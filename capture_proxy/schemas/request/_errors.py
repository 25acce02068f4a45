"""The one error a request can fail validation or normalization with, and how msgspec's errors map
onto it.

A refused request is answered with an OpenAI-style error body whose ``param`` is the JSON path of
the offending value (``messages[3].thinking_trace``) and whose message names that path again, so a
person reading only the message knows where to look.
"""

from __future__ import annotations

import re

import msgspec

from ...errors import CaptureProxyError

__all__ = ["RequestValidationError", "from_msgspec_error", "json_type_name", "not_an_object"]


class RequestValidationError(CaptureProxyError):
    """A request the proxy refuses before forwarding anything.

    Attributes:
        param: the JSON path of the offending value without a leading ``$.``, e.g.
            ``messages[3].thinking_trace`` or ``n``; ``""`` when the whole body is at fault.
        message: one sentence that names the path.
        code: a short machine-readable reason: ``unknown_field``, ``missing_field``,
            ``invalid_type``, ``invalid_value``, ``reasoning_conflict``, ``capture_disabled``,
            ``unsupported_content``, ``remote_media_refused``, ``invalid_image``,
            ``attachment_too_large``, ``free_json_too_large``, ``free_json_too_many_items``,
            ``json_too_many_items``.
        status: the HTTP status to answer with (422, or 413 for an oversized attachment,
            free-form value or body).
    """

    #: The OpenAI error ``type`` every request error is reported under.
    type = "invalid_request_error"

    def __init__(self, param: str, message: str, code: str, *, status: int = 422) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code
        self.status = status

    def __repr__(self) -> str:
        return f"RequestValidationError(param={self.param!r}, code={self.code!r}, {self.message!r})"


def json_type_name(value: object) -> str:
    """The JSON type of a decoded value, spelled as msgspec spells it in its errors."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, str):
        return "str"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return type(value).__name__


def not_an_object(value: object) -> RequestValidationError:
    """The error for a body that is not a JSON object (``param`` is ``""``: the whole body)."""
    return RequestValidationError(
        "", f"The request body must be a JSON object, got `{json_type_name(value)}`", "invalid_type"
    )


# Keys that look plausible but are not (or no longer) part of the schema. vLLM silently ignores
# unknown top-level keys, so sending one of these to vLLM 0.32 would quietly drop a constraint:
# say what to send instead.
_HINTS = {
    "guided_json": 'vLLM removed it; send `structured_outputs: {"json": ...}` instead',
    "guided_regex": 'vLLM removed it; send `structured_outputs: {"regex": ...}` instead',
    "guided_choice": 'vLLM removed it; send `structured_outputs: {"choice": [...]}` instead',
    "guided_grammar": 'vLLM removed it; send `structured_outputs: {"grammar": ...}` instead',
    "guided_whitespace_pattern": "vLLM removed it; send "
    '`structured_outputs: {"whitespace_pattern": ...}` instead',
    "guided_decoding_backend": "vLLM removed it; the backend is a server setting",
    "functions": "the legacy functions API is not supported; send `tools` instead",
    "function_call": "the legacy functions API is not supported; send `tools`/`tool_calls` instead",
    "best_of": "it is not a Chat Completions parameter (capture stages one completion per call)",
    "thinking": 'send `chat_template_kwargs: {"enable_thinking": ...}` instead',
}

_ROLES = "system, developer, user, assistant, tool"
_PART_TYPES = "text, image_url (user messages), refusal (assistant messages)"

# "<problem> - at `$.path`", or "<problem> - at `key` in `$.path`" for a bad object key.
_AT = re.compile(r"^(?P<text>.*?)(?: - at `(?P<key>key` in `)?(?P<path>\$[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<name>.*)`$", re.DOTALL)
_TYPE = re.compile(r"^Expected `(?P<want>[^`]*)`, got `(?P<got>[^`]*)`$")
_BAD_TAG = re.compile(r"^Invalid value (?P<value>.*)$", re.DOTALL)


def _clip(text: str, limit: int = 120) -> str:
    """Client-chosen names and values go into messages: keep a hostile one from filling a log."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _locate(path: str) -> tuple[str, str]:
    """(param, where) for a msgspec path: ``$.messages[3].content`` -> ``messages[3].content``.

    msgspec writes ``[...]`` for "some value of this object" without saying which key: the param
    then stops at that object, and `where` says the problem is in one of its values.
    """
    param = path.removeprefix("$").removeprefix(".")
    inside, dots, _ = param.partition("[...]")
    if dots:
        param = _clip(inside, 400)
        return param, f"a value of {param}" if param else "a value of the request body"
    param = _clip(param, 400)
    return param, param if param else "the top level of the request body"


def _join(base: str, name: str) -> str:
    return f"{base}.{name}" if base else name


def from_msgspec_error(exc: msgspec.ValidationError) -> RequestValidationError:
    """Map msgspec's ``"<problem> - at `$.path`"`` text to a `RequestValidationError`."""
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches any string
    text = match.group("text")
    param, where = _locate(match.group("path") or "$")
    type_match = _TYPE.match(text)

    if match.group("key"):
        return RequestValidationError(
            param,
            f"Invalid key in {where}: {text[0].lower()}{text[1:]}",
            "invalid_type" if type_match else "invalid_value",
        )
    if m := _UNKNOWN.match(text):
        name = _clip(m.group("name"))
        hint = _HINTS.get(name) if not param else None
        tail = hint if hint else "the Chat Completions schema does not allow it"
        # The message names the full path (docs/contract.md), not just the object holding the key.
        full = _join(param, name)
        at = full if param else where
        return RequestValidationError(
            full, f"Unknown field `{name}` at {at}; {tail}", "unknown_field"
        )
    if m := _MISSING.match(text):
        name = _clip(m.group("name"))
        full = _join(param, name)
        return RequestValidationError(
            full, f"Missing required field `{name}` at {full}", "missing_field"
        )
    if type_match:
        if not param:
            return RequestValidationError(
                "",
                f"The request body must be a JSON object, got `{type_match.group('got')}`",
                "invalid_type",
            )
        return RequestValidationError(param, f"{text} at {where}", "invalid_type")
    if (m := _BAD_TAG.match(text)) or text.startswith("Invalid enum value "):
        value = _clip(m.group("value") if m else text.removeprefix("Invalid enum value "))
        if param.endswith(".role"):
            message = f"Unsupported role {value} at {param}; allowed roles: {_ROLES}"
        elif param.endswith(".type") and ".content[" in param:
            message = f"Unsupported content part type {value} at {param}; allowed: {_PART_TYPES}"
        else:
            message = f"Invalid value {value} at {where}"
        return RequestValidationError(param, message, "invalid_value")
    # Constraint violations: "Expected `int` >= 1", "Expected `array` of length <= 4", ...
    return RequestValidationError(param, f"{text} at {where}", "invalid_value")
