"""The strict Chat Completions request schema: OpenAI's fields plus the vLLM extensions the proxy
allows, each listed (see ``docs/request-schema.md`` for the table and the capture policy).

`validate_request` turns a decoded JSON body into a typed `ChatCompletionRequest` or raises
`RequestValidationError` naming the JSON path of the first problem. Unknown keys are an error at
every level: vLLM silently ignores unknown top-level keys, so a misspelt or outdated parameter
would otherwise change nothing and say nothing.

The typed view is for reading; the proxy forwards the (normalized) dict it was built from, so
the Structs declare each field's type and bounds but never need to re-encode.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ._errors import RequestValidationError, from_msgspec_error, not_an_object
from ._free_json import INT64_MAX, INT64_MIN
from ._limits import FreeJsonLimits
from ._messages import Message
from ._params import (
    FunctionDefinition,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    StructuredOutputs,
    Tool,
)
from ._policy import check_capturable, check_consistency, check_free_values
from ._strict import Strict

__all__ = [
    "MAX_MESSAGES",
    "MAX_TOOLS",
    "ChatCompletionRequest",
    "FunctionDefinition",
    "NamedToolChoice",
    "RequestValidationError",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputs",
    "Tool",
    "check_capturable",
    "validate_request",
]

#: Messages per request and tools per request. A long agent session has hundreds of messages;
#: these only stop a hostile body from making per-message work the cost of a call.
MAX_MESSAGES = 100_000
MAX_TOOLS = 1024

_INT64 = Meta(ge=INT64_MIN, le=INT64_MAX)
# Token counts and ids fit in 32 bits (vLLM's own limit); the bound also keeps every integer the
# request carries encodable by the digest (int64).
_I32_MAX = 2**31 - 1
TokenId = Annotated[int, Meta(ge=0, le=_I32_MAX)]


class ChatCompletionRequest(Strict):
    """A validated Chat Completions request (``POST /v1/chat/completions``).

    Fields are OpenAI's first, then vLLM's sampling parameters, then vLLM's extensions. A field
    the client did not send is ``None`` (or its documented default); the dict that is forwarded
    keeps exactly the keys the client sent.
    """

    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
    model: str | None = None
    # -- OpenAI ----------------------------------------------------------------------------------
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    logit_bias: (
        Annotated[
            dict[
                Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")],
                Annotated[float, Meta(ge=-100.0, le=100.0)],
            ],
            Meta(max_length=4096),
        ]
        | None
    ) = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=_I32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=_I32_MAX)] | None = None
    n: Annotated[int, Meta(ge=1, le=_I32_MAX)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    response_format: ResponseFormat | None = None
    seed: Annotated[int, _INT64] | None = None
    stop: str | Annotated[list[str], Meta(max_length=64)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    metadata: (
        Annotated[
            dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
            Meta(max_length=16),
        ]
        | None
    ) = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    # -- vLLM sampling parameters ------------------------------------------------------------------
    top_k: Annotated[int, Meta(ge=-1, le=_I32_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    length_penalty: float | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=_I32_MAX)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=4096)] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    use_beam_search: bool | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(max_length=2**20)] | None = None
    bad_words: Annotated[list[str], Meta(max_length=4096)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=_I32_MAX)] | None = None
    thinking_token_budget: Annotated[int, Meta(ge=-1, le=_I32_MAX)] | None = None
    # -- vLLM extensions -------------------------------------------------------------------------
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    documents: Annotated[list[dict[str, str]], Meta(max_length=4096)] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: Annotated[int, _INT64] | None = None
    request_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None
    include_reasoning: bool | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    routed_experts_prompt_start: Annotated[int, Meta(ge=0, le=_I32_MAX)] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    kv_transfer_params: dict[str, Any] | None = None


def validate_request(
    data: Any, *, free_json: FreeJsonLimits | None = None
) -> ChatCompletionRequest:
    """Validate a decoded JSON body against the strict schema and the capture policy.

    Raises `RequestValidationError` for the first problem found: an unknown key, a missing or
    mistyped field, an out-of-range value, an inconsistent combination (``stream_options``
    without ``stream``, ``top_logprobs`` without ``logprobs``, ...), or a parameter that would
    defeat capture (`check_capturable`), or free-form JSON over `free_json` (the defaults of
    `FreeJsonLimits` when None).

    Assistant reasoning must be under ``reasoning_content``: call
    `capture_proxy.core.normalize.normalize_request`, which renames OpenCode's ``reasoning`` first.
    """
    if not isinstance(data, dict):
        raise not_an_object(data)
    try:
        request = msgspec.convert(data, ChatCompletionRequest, strict=True)
    except msgspec.ValidationError as exc:
        raise from_msgspec_error(exc) from exc
    except RecursionError as exc:
        raise RequestValidationError(
            "", "The request body is nested too deeply to validate", "invalid_value"
        ) from exc
    check_free_values(request, free_json)
    check_consistency(request)
    check_capturable(request)
    return request
