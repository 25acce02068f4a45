"""Parameter objects of a Chat Completions request: tools, tool choice, stream options, response
formats and vLLM's structured outputs. Strict msgspec Structs: unknown keys are an error.
"""

from __future__ import annotations

from typing import Any, Literal

from ._messages import NonEmptyStr
from ._strict import Strict

__all__ = [
    "FunctionDefinition",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaResponseFormat",
    "NamedFunction",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "StructuralTagFormat",
    "StructuralTagItem",
    "StructuredOutputs",
    "TextFormat",
    "Tool",
]


class FunctionDefinition(Strict):
    """A tool's function: ``parameters`` is a free JSON Schema object."""

    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    """``{"type": "function", "function": {...}}``."""

    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(Strict):
    name: NonEmptyStr


class NamedToolChoice(Strict):
    """``{"type": "function", "function": {"name": ...}}``: force one tool."""

    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(Strict):
    """``include_usage`` (OpenAI) and ``continuous_usage_stats`` (vLLM: usage on every chunk)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(Strict):
    name: NonEmptyStr
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Strict, tag="text", tag_field="type"):
    pass


class JsonObjectFormat(Strict, tag="json_object", tag_field="type"):
    pass


class JsonSchemaResponseFormat(Strict, tag="json_schema", tag_field="type"):
    json_schema: JsonSchemaFormat


class StructuralTagItem(Strict):
    begin: str
    end: str
    schema: dict[str, Any] | None = None


class StructuralTagFormat(Strict, tag="structural_tag", tag_field="type"):
    """vLLM's structural tags: the legacy ``structures`` + ``triggers`` form or ``format``."""

    structures: list[StructuralTagItem] | None = None
    triggers: list[str] | None = None
    format: Any = None


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat | StructuralTagFormat


class StructuredOutputs(Strict):
    """vLLM's constrained decoding (``structured_outputs``): one of json/regex/choice/grammar/
    json_object/structural_tag, plus whitespace options."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
