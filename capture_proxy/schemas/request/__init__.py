"""The strict Chat Completions request schema (msgspec), its error paths and the request policy.

`decode_request` turns a body into typed structs or a `RequestValidationError` that names the
JSON path of what was wrong; the private modules hold the messages, parameters, free-form JSON
bounds (`check_free_json_limits` checks them on a raw body, before decoding) and policy keys.
"""

from __future__ import annotations

from ._errors import (
    RequestValidationError,
    json_type_name,
    not_an_object,
)
from ._limits import (
    DEFAULT_MAX_FREE_JSON_BYTES,
    DEFAULT_MAX_FREE_JSON_ITEMS,
    DEFAULT_MAX_JSON_ITEMS,
    FreeJsonLimits,
    check_body_items,
    check_free_json_limits,
    count_body_items,
    too_many_body_items,
)
from ._messages import (
    ImagePart,
    UserMessage,
)
from ._params import (
    FunctionDefinition,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    StructuredOutputs,
    Tool,
)
from ._policy import (
    FREE_VALUES,
    FreeValueMemo,
    check_capturable,
)
from ._schema import (
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatCompletionRequest,
    validate_request,
)

__all__ = [
    "DEFAULT_MAX_FREE_JSON_BYTES",
    "DEFAULT_MAX_FREE_JSON_ITEMS",
    "DEFAULT_MAX_JSON_ITEMS",
    "FREE_VALUES",
    "MAX_MESSAGES",
    "MAX_TOOLS",
    "ChatCompletionRequest",
    "FreeJsonLimits",
    "FreeValueMemo",
    "FunctionDefinition",
    "ImagePart",
    "NamedToolChoice",
    "RequestValidationError",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputs",
    "Tool",
    "UserMessage",
    "check_body_items",
    "check_capturable",
    "check_free_json_limits",
    "count_body_items",
    "json_type_name",
    "not_an_object",
    "too_many_body_items",
    "validate_request",
]
