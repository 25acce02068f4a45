"""vLLM's wire shapes, the extraction result, and the checks shared by the streamed and plain paths.

The msgspec Structs here declare only the fields the adapter reads: vLLM adds fields release
after release, and an unknown field must never break a call (unknown fields are ignored when
decoding, and the client body is rebuilt from the untouched raw values, not from these Structs).
Decoders are built once at import and reused on the hot path.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import orjson

from ...errors import CaptureProxyError

__all__ = [
    "CaptureExtractionError",
    "ClientWants",
    "Completion",
    "ForwardPlan",
    "ReasoningField",
    "UpstreamProtocolError",
    "parse_error_body",
]

ReasoningField = Literal["reasoning_content", "reasoning"]


class CaptureExtractionError(CaptureProxyError):
    """The answer is fine for the client but cannot be staged exactly.

    `reason` is a stable slug for metrics and the ledger: ``missing_token_ids``,
    ``missing_logprobs``, ``missing_usage``, ``token_count_mismatch``, ``multiple_choices``,
    ``invalid_token_ids``, ``routed_experts_split``, ``invalid_media_spans``. `client_body` is
    set by `VLLMAdapter.parse_response`: the body to send the client anyway (policy ``poison``).
    """

    def __init__(self, reason: str, message: str, *, client_body: bytes | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.client_body = client_body


class UpstreamProtocolError(CaptureProxyError):
    """The upstream answer itself is broken; the client must not see it as a success.

    `reason`: ``malformed_json``, ``error_body``, ``error_event``, ``no_choices``,
    ``missing_finish_reason``, ``missing_done``, ``truncated_event``, ``empty_stream``,
    ``data_after_done``, ``event_too_large``, ``missing_logprobs``. `error_body` is an OpenAI error
    body (``{"error": {...}}``) describing the failure, ready to send as an SSE error event.
    """

    def __init__(
        self, reason: str, message: str, *, error_body: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.error_body = error_body or {
            "error": {
                "message": f"upstream protocol error ({reason}): {message}",
                "type": "upstream_error",
                "param": None,
                "code": 502,
            }
        }


@dataclass(frozen=True, slots=True)
class ClientWants:
    """What the client itself asked for, so the relay strips what it did not."""

    stream: bool
    #: The client sent ``logprobs: true``.
    logprobs: bool
    top_logprobs: int | None
    #: Stream: the client sent ``stream_options.include_usage: true``. Non-stream: always True.
    usage: bool
    #: The client itself sent ``return_token_ids: true`` (it may see token_ids / prompt_token_ids).
    token_ids: bool
    #: The client itself sent ``return_tokens_as_token_ids: true``.
    token_id_strings: bool
    #: Stream: the client asked for usage on every chunk (``stream_options`` with
    #: ``include_usage`` and ``continuous_usage_stats`` true, as vLLM reads them).
    continuous_usage: bool = False


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """The request to send upstream, and what to give back to the client."""

    #: The exact JSON bytes to POST upstream.
    body: bytes
    wants: ClientWants


@dataclass(frozen=True, slots=True)
class Completion:
    """What one call produced, extracted exactly (the streamed and plain paths agree).

    `message` is ``{"role": "assistant", "content", "reasoning_content"}`` plus ``tool_calls``
    (each ``{"id", "type", "function": {"name", "arguments"}}``) when the model called tools. Empty
    content or reasoning is None, so a streamed answer and the same answer unstreamed are equal.
    `extras` holds ``upstream_response_id``, ``system_fingerprint``, ``stop_reason`` and, when
    the upstream sent them non-null, ``routed_experts`` and ``media_spans``.
    """

    response_id: str
    model: str
    prompt_token_ids: array[int]
    completion_token_ids: array[int]
    completion_logprobs: array[float]
    finish_reason: str
    stop_reason: int | str | None
    message: dict[str, Any]
    usage: dict[str, int]
    extras: dict[str, Any]


# --- wire Structs: only the fields we read -------------------------------------------------


# gc=False: these Structs hold no reference cycles, and a 1k-token answer makes 1k of them; kept
# out of the cyclic GC, they do not trigger collections that would scan the whole heap.


class Logprob(msgspec.Struct, gc=False):
    #: Kept raw: only the fallback for answers without ``token_ids`` reads it.
    token: msgspec.Raw
    logprob: float


class Logprobs(msgspec.Struct, gc=False):
    content: list[Logprob] | None = None


class Function(msgspec.Struct, gc=False):
    name: str | None = None
    arguments: str | None = None


class WireToolCall(msgspec.Struct, gc=False):
    index: int = 0
    id: str | None = None
    type: str | None = None
    function: Function | None = None


class Message(msgspec.Struct, gc=False):
    """A non-streamed message, or a streamed delta: vLLM uses the same field names in both."""

    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[WireToolCall] | None = None


class Usage(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int | None = None


RawDict = dict[str, msgspec.Raw]

decode_object = msgspec.json.Decoder(RawDict).decode
decode_choices = msgspec.json.Decoder(list[RawDict]).decode
decode_message = msgspec.json.Decoder(Message).decode
decode_logprobs = msgspec.json.Decoder(Logprobs | None).decode
decode_ids = msgspec.json.Decoder(list[int] | None).decode
decode_str = msgspec.json.Decoder(str | None).decode
decode_stop_reason = msgspec.json.Decoder(int | str | None).decode
decode_usage = msgspec.json.Decoder(Usage | None).decode
decode_int = msgspec.json.Decoder(int | None).decode
decode_any = msgspec.json.decode
encode = msgspec.json.Encoder().encode

NULL = msgspec.Raw(b"null")
EMPTY_OBJECT = msgspec.Raw(b"{}")

#: Top-level fields that exist only because the proxy asked for token ids.
TOKEN_ID_FIELDS = ("prompt_token_ids", "prompt_text")
#: Top-level fields the proxy never asks for: relayed only when the upstream filled them (then
#: the client asked); their nulls are dropped.
NULL_DROPPED_FIELDS = ("prompt_logprobs", "kv_transfer_params", "ec_transfer_params")
_TOKEN_ID_PREFIX = "token_id:"


def is_null(raw: msgspec.Raw | None) -> bool:
    """True for a missing or JSON-null value (a Raw holds the value's bytes without whitespace)."""
    # Check the length first: copying a 100 KB logprobs value just to compare it is wasteful.
    return raw is None or (len(raw) == 4 and bytes(raw) == b"null")


def strip_for_client(
    top: RawDict, choices: list[RawDict], wants: ClientWants
) -> dict[str, Any] | None:
    """`top` with what the client did not ask for removed, or None when nothing needs removing.

    Key order and every kept value's bytes are preserved (values stay `msgspec.Raw`).
    """
    drop_usage = wants.stream and not wants.usage
    changed = False
    new_choices: list[dict[str, Any]] = []
    for choice in choices:
        c: dict[str, Any] = {}
        for key, value in choice.items():
            if key == "routed_experts" or (key == "token_ids" and not wants.token_ids):
                changed = True
            elif key == "logprobs" and not wants.logprobs and not is_null(value):
                c[key] = NULL
                changed = True
            else:
                c[key] = value
        new_choices.append(c)
    body: dict[str, Any] = {}
    for key, value in top.items():
        if (
            (key in TOKEN_ID_FIELDS and not wants.token_ids)
            or (key in NULL_DROPPED_FIELDS and is_null(value))
            or (key == "usage" and drop_usage)
        ):
            changed = True
        elif key == "choices":
            body[key] = new_choices
        else:
            body[key] = value
    return body if changed else None


def ids_from_logprob_tokens(entries: list[Logprob]) -> list[int] | None:
    """Ids from ``"token_id:N"`` logprob tokens (``return_tokens_as_token_ids``), else None."""
    out: list[int] = []
    for e in entries:
        token = decode_str(e.token)
        if token is None or not token.startswith(_TOKEN_ID_PREFIX):
            return None
        try:
            out.append(int(token[len(_TOKEN_ID_PREFIX) :]))
        except ValueError:
            return None
    return out


def to_ids(field: str, values: list[int]) -> array[int]:
    """`values` as an int32 array; `CaptureExtractionError` if one does not fit in int32."""
    ids = array("i")
    try:
        # struct packs a list about twice as fast as array("i", values) converts it.
        ids.frombytes(struct.pack(f"={len(values)}i", *values))
    except struct.error as exc:
        bad = next((v for v in values if not -(2**31) <= v < 2**31), None)
        raise CaptureExtractionError(
            "invalid_token_ids", f"{field}: token id {bad} does not fit in int32"
        ) from exc
    return ids


def normalize_tool_call(tc: WireToolCall) -> dict[str, Any]:
    fn = tc.function or Function()
    return {
        "id": tc.id,
        "type": tc.type or "function",
        "function": {"name": fn.name, "arguments": fn.arguments or ""},
    }


def build_message(
    content: str | None, reasoning: str | None, tool_calls: list[dict[str, Any]]
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content or None,
        "reasoning_content": reasoning or None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def check_counts(
    prompt: array[int] | None,
    completion: array[int],
    logprobs: array[float],
    usage: Usage | None,
) -> tuple[array[int], Usage]:
    """Cross-check token data against usage; returns (prompt, usage) or raises."""
    if prompt is None:
        raise CaptureExtractionError("missing_token_ids", "the upstream sent no prompt_token_ids")
    if usage is None:
        raise CaptureExtractionError("missing_usage", "the upstream sent no usage")
    if len(completion) and not len(logprobs):
        raise CaptureExtractionError(
            "missing_logprobs", f"{len(completion)} completion tokens but no logprobs"
        )
    counts = (len(prompt), usage.prompt_tokens, len(completion), usage.completion_tokens)
    if counts[0] != counts[1] or not counts[2] == counts[3] == len(logprobs):
        raise CaptureExtractionError(
            "token_count_mismatch",
            f"prompt ids {counts[0]} vs usage.prompt_tokens {counts[1]}; completion ids "
            f"{counts[2]} vs usage.completion_tokens {counts[3]} vs logprobs {len(logprobs)}",
        )
    return prompt, usage


def usage_dict(usage: Usage) -> dict[str, int]:
    total = usage.total_tokens
    if total is None:
        total = usage.prompt_tokens + usage.completion_tokens
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": total,
    }


def make_extras(
    response_id: str,
    system_fingerprint: str | None,
    stop_reason: int | str | None,
    routed_experts: Any,
    media_spans: Any,
) -> dict[str, Any]:
    extras: dict[str, Any] = {
        "upstream_response_id": response_id,
        "system_fingerprint": system_fingerprint,
        "stop_reason": stop_reason,
    }
    if routed_experts is not None:
        extras["routed_experts"] = routed_experts
    if media_spans is not None:
        check_media_spans(media_spans)
        extras["media_spans"] = media_spans
    return extras


def check_media_spans(media_spans: Any) -> None:
    """Refuse ``media_spans`` that are not a list of JSON objects (`CaptureExtractionError`).

    A trainer maps each span onto the prompt's tokens; a string, a number or a list that mixes
    objects with other values cannot say where an image sits, so staging it would hand the
    trainer a record it cannot use while looking complete.
    """
    if not isinstance(media_spans, list):
        raise CaptureExtractionError(
            "invalid_media_spans",
            f"media_spans must be a list of objects, got {_json_type(media_spans)}",
        )
    for i, span in enumerate(media_spans):
        if not isinstance(span, dict):
            raise CaptureExtractionError(
                "invalid_media_spans",
                f"media_spans[{i}] must be an object, got {_json_type(span)}",
            )


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, as the upstream wrote it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else "null"


def parse_error_body(raw: bytes, status: int) -> dict[str, Any]:
    """The OpenAI error body ``{"error": {message, type, param, code}}`` for an upstream error.

    Accepts vLLM's current shape (``{"error": {...}}``), its older flat one (``{"object": "error",
    "message": ...}``) and anything else (a proxy's HTML page, plain text), which is wrapped with
    its first 1000 characters as the message.
    """
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
    err: Any = None
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed if "message" in parsed else None)
        if isinstance(err, str):
            err = {"message": err}
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return {
            "error": {
                "message": err["message"],
                "type": err.get("type") if isinstance(err.get("type"), str) else "upstream_error",
                "param": err.get("param"),
                "code": err.get("code", status),
            }
        }
    text = raw[:1000].decode("utf-8", "replace").strip()
    return {
        "error": {
            "message": f"upstream answered HTTP {status}: {text}"
            if text
            else f"upstream answered HTTP {status} with an empty body",
            "type": "upstream_error",
            "param": None,
            "code": status,
        }
    }
