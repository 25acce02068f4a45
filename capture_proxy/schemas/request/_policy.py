"""What a schema-valid request must also satisfy before it is forwarded: stageable free-form
values, consistent parameter combinations, and the capture policy (``docs/request-schema.md``).

Each check raises `RequestValidationError` naming the JSON path; `validate_request` runs them in
this order after the schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson

from ..digest import has_null_token
from ._errors import RequestValidationError
from ._free_json import check_free_json
from ._limits import FreeJsonLimits, count_items, too_large, too_many_items
from ._messages import UNSTORABLE_PARTS, UserMessage
from ._params import JsonSchemaResponseFormat, NamedToolChoice, StructuralTagFormat

if TYPE_CHECKING:
    from ._schema import ChatCompletionRequest

__all__ = [
    "FREE_VALUES",
    "FreeValueMemo",
    "check_capturable",
    "check_consistency",
    "check_free_values",
]


class FreeValueMemo:
    """The JSON value counts of free-form values that passed `check_free_json`, keyed by their
    JSON bytes, so that the tool schemas an agent re-sends with every call are walked once.

    Equal bytes mean an equal value, hence the same verdict and count, except where orjson's
    output is ambiguous, which is never used as a key: a ``null`` token (orjson writes NaN and
    infinities as ``null``), and values orjson cannot write exactly (subclasses of JSON types,
    non-string keys, integers beyond 64 bits) are checked in full every time. Values under
    `min_bytes` are not kept (walking them costs less). Bounded by the bytes of its keys: cleared
    when `max_bytes` would be passed; a value over a quarter of it is never kept. A dict shared
    between threads: a lost update only costs a walk.
    """

    def __init__(self, max_bytes: int = 16 * 2**20, min_bytes: int = 256) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        #: Bytes of keys held now.
        self.bytes = 0
        self._items: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def key(self, value: Any) -> bytes | None:
        """`value`'s JSON, or None when it cannot be a key (above) or is not worth keeping."""
        try:
            key = orjson.dumps(value, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
        except (TypeError, orjson.JSONEncodeError):
            return None
        if not self.min_bytes <= len(key) <= self.max_bytes // 4 or has_null_token(key):
            return None
        return key

    def get(self, key: bytes) -> int | None:
        return self._items.get(key)

    def put(self, key: bytes, items: int) -> None:
        if key in self._items:
            return
        if self.bytes + len(key) > self.max_bytes:
            self._items.clear()
            self.bytes = 0
        self._items[key] = items
        self.bytes += len(key)


#: The process's memo of checked free-form values (`check_free_values`).
FREE_VALUES = FreeValueMemo()


def check_free_values(req: ChatCompletionRequest, limits: FreeJsonLimits | None = None) -> None:
    """Free-form values must be stageable (see `check_free_json`) and within `limits`: bytes of
    JSON per value, JSON values over all of them (``_limits`` says why). A value checked before
    (`FREE_VALUES`) is not walked again."""
    limits = limits or FreeJsonLimits()
    total = 0
    for param, value in _free_values(req):
        if value is None:
            continue
        key = None if type(value) is str else FREE_VALUES.key(value)
        items = None if key is None else FREE_VALUES.get(key)
        if items is None:
            check_free_json(value, param)
        # A string's length is a lower bound of its JSON: enough to refuse, free to compute.
        if type(value) is str:
            size = len(value)
        else:
            size = len(key) if key is not None else len(orjson.dumps(value))
        if size > limits.max_bytes:
            raise too_large(param, size, limits)
        if items is None:
            items = count_items(value, limits.max_items - total)
            if key is not None and total + items <= limits.max_items:
                FREE_VALUES.put(key, items)  # counted in full: within the budget
        total += items
        if total > limits.max_items:
            raise too_many_items(param, limits)


def _free_values(req: ChatCompletionRequest) -> Iterator[tuple[str, Any]]:
    for i, tool in enumerate(req.tools or ()):
        if tool.function.parameters is not None:
            yield f"tools[{i}].function.parameters", tool.function.parameters
    fmt = req.response_format
    if isinstance(fmt, JsonSchemaResponseFormat) and fmt.json_schema.schema is not None:
        yield "response_format.json_schema.schema", fmt.json_schema.schema
    elif isinstance(fmt, StructuralTagFormat):
        yield "response_format.format", fmt.format
        for k, item in enumerate(fmt.structures or ()):
            yield f"response_format.structures[{k}].schema", item.schema
    if req.structured_outputs is not None:
        yield "structured_outputs.json", req.structured_outputs.json
    for name in _FREE_FIELDS:
        value = getattr(req, name)
        if value is not None:
            yield name, value


_FREE_FIELDS = (
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "kv_transfer_params",
    "vllm_xargs",
)


def _invalid(param: str, message: str) -> RequestValidationError:
    return RequestValidationError(param, message, "invalid_value")


def check_consistency(req: ChatCompletionRequest) -> None:
    """Combinations vLLM (and OpenAI) refuse: refuse them here, before anything is forwarded."""
    if req.stream_options is not None and not req.stream:
        raise _invalid("stream_options", "`stream_options` at stream_options needs `stream: true`")
    if req.top_logprobs and not req.logprobs:
        raise _invalid("top_logprobs", "`top_logprobs` at top_logprobs needs `logprobs: true`")
    if req.prompt_logprobs and req.stream:
        raise _invalid(
            "prompt_logprobs",
            "`prompt_logprobs` at prompt_logprobs is not available with streaming",
        )
    if req.continue_final_message and req.add_generation_prompt is not False:
        raise _invalid(
            "continue_final_message",
            "`continue_final_message: true` at continue_final_message needs "
            "`add_generation_prompt: false`",
        )
    choice = req.tool_choice
    if choice is not None and choice != "none":
        if not req.tools:
            raise _invalid("tool_choice", "`tool_choice` at tool_choice needs a non-empty `tools`")
        if isinstance(choice, NamedToolChoice):
            names = {tool.function.name for tool in req.tools}
            if choice.function.name not in names:
                raise _invalid(
                    "tool_choice.function.name",
                    f"Tool {choice.function.name!r:.80} at tool_choice.function.name is not one "
                    "of the request's `tools`",
                )


def check_capturable(req: ChatCompletionRequest) -> None:
    """Refuse parameters that would make the call impossible to stage faithfully.

    The policy, per field (``docs/request-schema.md`` explains each):

    - ``include_reasoning: false``: vLLM then drops token ids and logprobs -> refused.
    - ``n > 1``, ``use_beam_search: true``: capture stages one sampled completion per call.
    - ``echo: true``: the answer's text would start with prompt text the model did not generate.
    - ``modalities`` with ``audio``; audio, file and video content parts: the capture stores
      text and images only.

    ``return_token_ids: false`` and ``logprobs: false`` are allowed: the adapter asks vLLM for
    them anyway and strips them from the client's answer.
    """
    if req.include_reasoning is False:
        raise RequestValidationError(
            "include_reasoning",
            "`include_reasoning: false` at include_reasoning makes vLLM drop the token ids and "
            "logprobs the capture stages; to turn thinking off send `chat_template_kwargs: "
            '{"enable_thinking": false}` instead',
            "capture_disabled",
        )
    if req.n is not None and req.n > 1:
        raise RequestValidationError(
            "n",
            f"`n: {req.n}` at n is not supported: the capture stages one completion per call; "
            "send separate calls instead",
            "capture_disabled",
        )
    if req.use_beam_search:
        raise RequestValidationError(
            "use_beam_search",
            "`use_beam_search: true` at use_beam_search is not supported: beam search does not "
            "sample from the policy, so its tokens and logprobs are not trainable samples",
            "capture_disabled",
        )
    if req.echo:
        raise RequestValidationError(
            "echo",
            "`echo: true` at echo is not supported: the answer would start with prompt text the "
            "model did not generate, which no longer matches its completion token ids",
            "capture_disabled",
        )
    if req.modalities is not None and "audio" in req.modalities:
        raise RequestValidationError(
            "modalities",
            "Audio output at modalities is not supported: the capture stores text and images only",
            "unsupported_content",
        )
    for i, message in enumerate(req.messages):
        if not isinstance(message, UserMessage) or isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            what = UNSTORABLE_PARTS.get(type(part))
            if what is not None:
                kind = type(part).__struct_config__.tag
                raise RequestValidationError(
                    f"messages[{i}].content[{j}]",
                    f"Content part type {kind!r} at messages[{i}].content[{j}] is not supported: "
                    f"the capture stores text and images, not {what}",
                    "unsupported_content",
                )
