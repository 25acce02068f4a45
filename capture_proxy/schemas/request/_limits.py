"""Size limits on a request's JSON, checked on the raw body before it is decoded.

A whole body first: `check_body_items` bounds the number of JSON values a body can decode into
(``--max-json-items``) with a count of its commas, brackets and braces, before anything is
parsed. An array of 22 million ``{}`` is 63 MiB of JSON (under the body limit) and 2 GB of
Python once decoded, and the decode holds the interpreter lock for seconds: the limits of the
schema (``messages`` length <= 100,000, ...) would refuse it only once it was built.

Then free-form values.

Free-form values (``chat_template_kwargs``, tool ``parameters``, ``mm_processor_kwargs``, ...)
are JSON the schema cannot type. Decoded into Python, a compact hostile value costs up to ~30
times its JSON size (``{}`` is 3 bytes of JSON and ~90 bytes of Python), and every later step of
a call (validation, the request key, the digest) walks it on top. So each value is bounded in
bytes, and all of a request's free-form values together in the number of JSON values they hold;
both limits are settings (``--max-free-json-bytes``, ``--max-free-json-items``).

`check_free_json_limits` reads only the *raw body*: msgspec skips everything but the free-form
values, which it returns as byte slices, so a hostile body is refused before a single Python
object is built for it. `check_free_json` (in ``_free_json``) checks the same limits again on
decoded values, for callers that hand over a decoded request. Images are not free-form values:
they have their own per-image limit (``attachment_too_large``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
from msgspec import Raw, Struct

from ._errors import RequestValidationError, from_msgspec_error

__all__ = [
    "DEFAULT_MAX_FREE_JSON_BYTES",
    "DEFAULT_MAX_FREE_JSON_ITEMS",
    "DEFAULT_MAX_JSON_ITEMS",
    "FreeJsonLimits",
    "check_body_items",
    "check_free_json_limits",
    "count_items",
    "too_large",
    "too_many_items",
]

#: Largest free-form value, in bytes of JSON. Agent tool schemas are 1-20 KB each.
DEFAULT_MAX_FREE_JSON_BYTES = 2**20
#: JSON values (objects, arrays, numbers, strings, ...) in all free-form values of one request.
#: 128 tools of ~100 values each is ~13,000; at most ~128 bytes of Python each, the default keeps
#: a request's decoded free-form values under ~16 MB. Half the whole body's limit below.
DEFAULT_MAX_FREE_JSON_ITEMS = 131_072
#: Commas, brackets and braces in a whole body (``--max-json-items``). Each stands for at most
#: one decoded value (a value, an object member, an array), and a decoded value costs at most
#: ~128 bytes of Python beyond its own text (measured with orjson: a member of a large object
#: 126, a small message 98 per counted character, an empty object 36): the default keeps what
#: a body decodes into under its own size + 32 MiB, so under 4x any body over 11 MiB, and its
#: decode (one C call holding the interpreter lock) near 50 ms. An OpenCode call counts about
#: one per 67 bytes (~450 for its 30 KB): a 128k-token conversation is some 15,000; the count
#: includes punctuation inside strings, so text would need more than 262,144 commas and
#: brackets, more tokens than any context holds, to reach it.
DEFAULT_MAX_JSON_ITEMS = 262_144


@dataclass(frozen=True, slots=True)
class FreeJsonLimits:
    """How large a request's free-form JSON may be (see the module docs).

    Attributes:
        max_bytes: the largest free-form value, in bytes of JSON (``--max-free-json-bytes``).
        max_items: JSON values in all free-form values of one request, counted together
            (``--max-free-json-items``): counted per value, a request could repeat a value in
            each of its 1,024 tools.
    """

    max_bytes: int = DEFAULT_MAX_FREE_JSON_BYTES
    max_items: int = DEFAULT_MAX_FREE_JSON_ITEMS


def check_body_items(raw: bytes, max_items: int) -> None:
    """Refuse a raw body holding more than `max_items` commas, brackets and braces.

    Raises `RequestValidationError` (413, code ``json_too_many_items``, naming the setting).
    Nothing is decoded: `bytes.count` over slices of `_COUNT_SLICE` bytes (about 1 ns a byte),
    so a caller on a worker thread lets the event loop run between slices instead of stalling
    it for the whole body. Strings are not told apart from structure, so the count is an upper
    bound on what the body decodes into (see `DEFAULT_MAX_JSON_ITEMS`).
    """
    count = 0
    for char in (b",", b"[", b"{"):
        for start in range(0, len(raw), _COUNT_SLICE):
            count += raw.count(char, start, start + _COUNT_SLICE)
            if count > max_items:
                raise too_many_body_items(max_items)


def count_body_items(piece: bytes) -> int:
    """The commas, brackets and braces in `piece`, as `check_body_items` counts them: summed
    over a body's pieces as they arrive, the server refuses a body the moment it passes the
    limit, without receiving the rest (``capture_proxy.server.chat``)."""
    return piece.count(b",") + piece.count(b"[") + piece.count(b"{")


def too_many_body_items(max_items: int) -> RequestValidationError:
    """The refusal of a body holding more than `max_items` JSON values (413)."""
    return RequestValidationError(
        "",
        f"request body holds more than {max_items} JSON values (counted as its commas, "
        "brackets and braces, inside strings too; the proxy's --max-json-items)",
        "json_too_many_items",
        status=413,
    )


#: Bytes counted in one go by `check_body_items`: ~8 ms of holding the interpreter lock.
_COUNT_SLICE = 8 << 20


def too_large(param: str, size: int, limits: FreeJsonLimits) -> RequestValidationError:
    return RequestValidationError(
        param,
        f"Free-form value at {param} is {size} bytes of JSON, over the limit of "
        f"{limits.max_bytes} bytes (the proxy's --max-free-json-bytes)",
        "free_json_too_large",
        status=413,
    )


def too_many_items(param: str, limits: FreeJsonLimits) -> RequestValidationError:
    return RequestValidationError(
        param,
        f"Free-form values hold more than {limits.max_items} JSON values (the limit is passed "
        f"at {param}; the proxy's --max-free-json-items)",
        "free_json_too_many_items",
        status=413,
    )


def count_items(value: object, budget: int) -> int:
    """JSON values in `value` (itself included), counting stops past `budget`."""
    count = 0
    stack = [value]
    while stack:
        v = stack.pop()
        count += 1
        if count > budget:
            return count
        kind = type(v)
        if kind is dict:
            stack.extend(v.values())  # type: ignore[attr-defined]
        elif kind is list:
            stack.extend(v)  # type: ignore[arg-type]
    return count


# -- the shape of a body, as far as its free-form values -----------------------------------------
# Everything else is skipped by msgspec without being built. Fields that hold free-form values
# deeper down are read as Raw first and their inner shape decoded on its own, so a value of the
# wrong shape is still bounded (as a whole) instead of making the check give up.


class _Shape(Struct):
    tools: Raw = Raw()
    response_format: Raw = Raw()
    structured_outputs: Raw = Raw()
    chat_template_kwargs: Raw = Raw()
    mm_processor_kwargs: Raw = Raw()
    media_io_kwargs: Raw = Raw()
    kv_transfer_params: Raw = Raw()
    vllm_xargs: Raw = Raw()


class _Function(Struct):
    parameters: Raw = Raw()


class _Tool(Struct):
    function: _Function = msgspec.field(default_factory=_Function)


class _JsonSchema(Struct):
    schema: Raw = Raw()


class _Structure(Struct):
    schema: Raw = Raw()


class _ResponseFormat(Struct):
    json_schema: _JsonSchema = msgspec.field(default_factory=_JsonSchema)
    format: Raw = Raw()
    structures: list[_Structure] = msgspec.field(default_factory=list)


class _StructuredOutputs(Struct):
    json: Raw = Raw()


_BODY = msgspec.json.Decoder(_Shape)
_TOOLS = msgspec.json.Decoder(list[_Tool])
_FORMAT = msgspec.json.Decoder(_ResponseFormat)
_OUTPUTS = msgspec.json.Decoder(_StructuredOutputs)
_FREE_FIELDS = (
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "kv_transfer_params",
    "vllm_xargs",
)


def _inner(raw: Raw, decoder: msgspec.json.Decoder[Any]) -> Any:
    """`raw` decoded to its inner shape, or None if it has another shape (schema's business)."""
    try:
        return decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None


def _free_values(shape: _Shape) -> Iterator[tuple[str, Raw]]:
    if shape.tools:
        tools = _inner(shape.tools, _TOOLS)
        if isinstance(tools, list):
            for i, tool in enumerate(tools):
                yield f"tools[{i}].function.parameters", tool.function.parameters
        else:
            yield "tools", shape.tools
    if shape.response_format:
        fmt = _inner(shape.response_format, _FORMAT)
        if isinstance(fmt, _ResponseFormat):
            yield "response_format.json_schema.schema", fmt.json_schema.schema
            yield "response_format.format", fmt.format
            for k, item in enumerate(fmt.structures):
                yield f"response_format.structures[{k}].schema", item.schema
        else:
            yield "response_format", shape.response_format
    if shape.structured_outputs:
        outputs = _inner(shape.structured_outputs, _OUTPUTS)
        if isinstance(outputs, _StructuredOutputs):
            yield "structured_outputs.json", outputs.json
        else:
            yield "structured_outputs", shape.structured_outputs
    for name in _FREE_FIELDS:
        yield name, getattr(shape, name)


def check_free_json_limits(raw: bytes, limits: FreeJsonLimits) -> bool:
    """Check the free-form values of a raw JSON body against `limits`, before decoding it.

    Raises `RequestValidationError` (413, naming the value's JSON path and the setting that
    raises the limit) for a value over ``max_bytes`` or values holding more than ``max_items``
    JSON values together; for a body that is not a JSON object, the usual ``invalid_type``.
    Returns False if `raw` is not JSON at all (the caller's decoder then says why), else True.
    Costs about 1 ms per 2 MB of body; builds Python objects only for a body's free-form
    values, one at a time, and only when a cheap count of their brackets and commas (which
    over-counts: commas inside strings count too) exceeds ``max_items``.
    """
    try:
        shape = _BODY.decode(raw)
    except msgspec.ValidationError as exc:
        raise from_msgspec_error(exc) from exc  # only "not an object" can fail at this level
    except (msgspec.DecodeError, RecursionError):
        return False
    values = [(param, value) for param, value in _free_values(shape) if value]
    bound = 0
    for param, value in values:
        if len(value) > limits.max_bytes:
            raise too_large(param, len(value), limits)
        data = bytes(memoryview(value))  # at most max_bytes
        bound += data.count(b",") + data.count(b"[") + data.count(b"{") + 1
    if bound <= limits.max_items:
        return True
    # The cheap bound is over: count exactly, one value decoded at a time (each is small).
    total = 0
    for param, value in values:
        try:
            decoded = orjson.loads(bytes(memoryview(value)))
        except orjson.JSONDecodeError:
            continue  # orjson refuses what msgspec let through (NaN, ...): the decoder reports it
        total += count_items(decoded, limits.max_items - total)
        if total > limits.max_items:
            raise too_many_items(param, limits)
    return True
