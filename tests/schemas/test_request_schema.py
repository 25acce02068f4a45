"""The strict Chat Completions schema: what passes, and the exact error for what does not."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.schemas.digest import EncodingError, encode_value
from capture_proxy.schemas.request import (
    ChatCompletionRequest,
    NamedToolChoice,
    RequestValidationError,
    validate_request,
)
from capture_proxy.schemas.request._free_json import MAX_FREE_JSON_DEPTH, check_free_json
from capture_proxy.schemas.request._messages import (
    AssistantMessage,
    ImagePart,
    TextPart,
    ToolMessage,
    UserMessage,
)
from tests.support import FIXTURES, ROOT

VLLM_FIXTURES = FIXTURES / "vllm-0.32.0"
DOC = ROOT / "docs" / "request-schema.md"

USER = {"role": "user", "content": "hi"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": [USER], **fields}


def refused(data: Any) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as info:
        validate_request(data)
    err = info.value
    # Every error names its path in the message too (docs/contract.md, "Errors and limits").
    assert err.param in err.message
    assert err.status in (413, 422)
    assert err.type == "invalid_request_error"
    return err


def test_the_vllm_fixture_requests_are_there() -> None:
    # The parametrized tests below would silently collect nothing without them.
    names = {p.name for p in VLLM_FIXTURES.glob("*-request.json")}
    assert names >= {"chat-request.json", "tool-call-request.json"}


@pytest.mark.parametrize("path", sorted(VLLM_FIXTURES.glob("*-request.json")), ids=lambda p: p.name)
def test_real_vllm_fixture_requests_pass(path: Path) -> None:
    data = json.loads(path.read_text())
    req = validate_request(data)
    assert len(req.messages) == len(data["messages"])
    assert req.return_token_ids is True


def test_fixture_history_is_typed() -> None:
    data = json.loads((VLLM_FIXTURES / "chat-request.json").read_text())
    req = validate_request(data)
    assistant = req.messages[2]
    assert isinstance(assistant, AssistantMessage)
    assert assistant.reasoning_content == "I will list them."
    assert assistant.tool_calls is not None
    assert assistant.tool_calls[0].function.arguments == '{"command":"ls"}'
    assert isinstance(req.messages[3], ToolMessage)
    assert req.messages[3].tool_call_id == "call_1"
    assert req.tools is not None
    assert req.tools[0].function.parameters is not None


def test_typed_view_of_parts_and_defaults() -> None:
    req = validate_request(
        body(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}},
                    ],
                }
            ],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "bash"}},
        )
    )
    msg = req.messages[0]
    assert isinstance(msg, UserMessage)
    assert isinstance(msg.content, list)
    assert isinstance(msg.content[0], TextPart)
    assert isinstance(msg.content[1], ImagePart)
    assert msg.content[1].image_url.detail == "low"
    assert isinstance(req.tool_choice, NamedToolChoice)
    assert req.stream is None
    assert req.n is None
    assert req.temperature is None


@pytest.mark.parametrize(
    ("data", "param", "name"),
    [
        (body(thinking_trace=1), "thinking_trace", "thinking_trace"),
        (
            body(messages=[USER, USER, USER, {"role": "assistant", "thinking_trace": "x"}]),
            "messages[3].thinking_trace",
            "thinking_trace",
        ),
        (
            body(tools=[{"type": "function", "function": {"name": "bash", "foo": 1}}]),
            "tools[0].function.foo",
            "foo",
        ),
        (
            body(
                messages=[
                    USER,
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:,", "bar": 1}}
                        ],
                    },
                ]
            ),
            "messages[1].content[0].image_url.bar",
            "bar",
        ),
        (body(stream=True, stream_options={"x": 1}), "stream_options.x", "x"),
        (
            body(messages=[{"role": "user", "content": "a", "reasoning_content": "r"}]),
            "messages[0].reasoning_content",
            "reasoning_content",
        ),
        (
            body(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "function": {"name": "f", "arguments": "{}"}, "index": 0}
                        ],
                    }
                ]
            ),
            "messages[0].tool_calls[0].index",
            "index",
        ),
        (
            body(response_format={"type": "json_object", "schema": {}}),
            "response_format.schema",
            "schema",
        ),
    ],
)
def test_unknown_keys_are_refused_with_their_exact_path(data: Any, param: str, name: str) -> None:
    err = refused(data)
    assert err.code == "unknown_field"
    assert err.param == param
    assert f"Unknown field `{name}`" in err.message


def test_unknown_top_level_key_message() -> None:
    err = refused(body(thinking_trace=1))
    assert err.message == (
        "Unknown field `thinking_trace` at the top level of the request body; "
        "the Chat Completions schema does not allow it"
    )


def test_reasoning_is_not_a_schema_field() -> None:
    # validate_request sees canonical names only: normalize_request renames `reasoning` first.
    err = refused(body(messages=[USER, {"role": "assistant", "content": "", "reasoning": "r"}]))
    assert (err.code, err.param) == ("unknown_field", "messages[1].reasoning")


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("guided_json", "structured_outputs"),
        ("guided_regex", "structured_outputs"),
        ("functions", "tools"),
        ("best_of", "one completion per call"),
    ],
)
def test_removed_or_legacy_keys_say_what_to_send_instead(name: str, hint: str) -> None:
    err = refused(body(**{name: {}}))
    assert (err.code, err.param) == ("unknown_field", name)
    assert hint in err.message


@pytest.mark.parametrize(
    ("data", "param", "message"),
    [
        (
            body(messages=[{"role": "user", "content": 5}]),
            "messages[0].content",
            "Expected `str | array`, got `int` at messages[0].content",
        ),
        (body(max_tokens="32000"), "max_tokens", "Expected `int | null`, got `str` at max_tokens"),
        (
            body(max_tokens=32000.0),
            "max_tokens",
            "Expected `int | null`, got `float` at max_tokens",
        ),
        (body(stream="yes"), "stream", "Expected `bool | null`, got `str` at stream"),
        (body(n=True), "n", "Expected `int | null`, got `bool` at n"),
        (body(messages={"role": "user"}), "messages", "Expected `array`, got `object` at messages"),
        (body(messages=["hi"]), "messages[0]", "Expected `object`, got `str` at messages[0]"),
        (
            body(messages=[{"role": 1, "content": "x"}]),
            "messages[0].role",
            "Expected `str`, got `int` at messages[0].role",
        ),
        (body(metadata={"k": 1}), "metadata", "Expected `str`, got `int` at a value of metadata"),
        (body(vllm_xargs={"k": {"x": 1}}), "vllm_xargs", "got `object` at a value of vllm_xargs"),
        (
            body(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}
                        ],
                    }
                ]
            ),
            "messages[0].tool_calls[0].function.arguments",
            "Expected `str`, got `object` at messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_wrong_types_name_the_path(data: Any, param: str, message: str) -> None:
    err = refused(data)
    assert (err.code, err.param) == ("invalid_type", param)
    assert message in err.message


@pytest.mark.parametrize("data", [[], "x", 3, None, True, [{"messages": []}]])
def test_body_must_be_an_object(data: Any) -> None:
    err = refused(data)
    assert (err.code, err.param) == ("invalid_type", "")
    assert err.message.startswith("The request body must be a JSON object, got `")


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"model": "m"}, "messages"),
        (body(messages=[{"content": "x"}]), "messages[0].role"),
        (body(messages=[{"role": "user"}]), "messages[0].content"),
        (body(messages=[USER, {"role": "tool", "content": "out"}]), "messages[1].tool_call_id"),
        (
            body(messages=[{"role": "user", "content": [{"text": "a"}]}]),
            "messages[0].content[0].type",
        ),
        (body(tools=[{"type": "function"}]), "tools[0].function"),
        (
            body(tools=TOOLS, tool_choice={"type": "function", "function": {}}),
            "tool_choice.function.name",
        ),
    ],
)
def test_missing_fields_name_the_path(data: Any, param: str) -> None:
    err = refused(data)
    assert (err.code, err.param) == ("missing_field", param)
    assert err.message.startswith(f"Missing required field `{param.rsplit('.', 1)[-1]}` at ")


@pytest.mark.parametrize(
    ("data", "param"),
    [
        (body(messages=[]), "messages"),
        (body(n=0), "n"),
        (body(top_logprobs=21, logprobs=True), "top_logprobs"),
        (body(top_logprobs=-1, logprobs=True), "top_logprobs"),
        (body(temperature=-0.1), "temperature"),
        (body(top_p=0), "top_p"),
        (body(top_p=1.5), "top_p"),
        (body(max_tokens=0), "max_tokens"),
        (body(frequency_penalty=3), "frequency_penalty"),
        (body(prompt_logprobs=-1), "prompt_logprobs"),
        (body(logit_bias={"12": 101}), "logit_bias"),
        (body(logit_bias={"not-a-token": 1}), "logit_bias"),
        (body(stop=["s"] * 65), "stop"),
        (body(seed=2**63), "seed"),
        (body(stop_token_ids=[-1]), "stop_token_ids[0]"),
        (body(cache_salt=""), "cache_salt"),
        (body(reasoning_effort="extreme"), "reasoning_effort"),
        (body(tool_choice="sometimes", tools=TOOLS), "tool_choice"),
        (
            body(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "x", "detail": "ultra"}}
                        ],
                    }
                ]
            ),
            "messages[0].content[0].image_url.detail",
        ),
        (
            body(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "custom",
                                "function": {"name": "f", "arguments": ""},
                            }
                        ],
                    }
                ]
            ),
            "messages[0].tool_calls[0].type",
        ),
    ],
)
def test_out_of_bounds_values_are_refused(data: Any, param: str) -> None:
    err = refused(data)
    assert (err.code, err.param) == ("invalid_value", param)


def test_bound_message_reads_well() -> None:
    assert refused(body(n=0)).message == "Expected `int` >= 1 at n"


def test_legacy_function_role_is_refused_with_the_allowed_roles() -> None:
    err = refused(body(messages=[{"role": "function", "name": "f", "content": "x"}]))
    assert (err.code, err.param) == ("invalid_value", "messages[0].role")
    assert "'function'" in err.message
    assert "system, developer, user, assistant, tool" in err.message


@pytest.mark.parametrize(
    ("role", "part"),
    [
        ("assistant", {"type": "image_url", "image_url": {"url": "data:,"}}),
        ("system", {"type": "image_url", "image_url": {"url": "data:,"}}),
        ("tool", {"type": "refusal", "refusal": "no"}),
        ("user", {"type": "thinking", "thinking": "hm"}),
    ],
)
def test_content_part_type_not_allowed_for_the_role(role: str, part: dict[str, Any]) -> None:
    message: dict[str, Any] = {"role": role, "content": [part]}
    if role == "tool":
        message["tool_call_id"] = "c"
    err = refused(body(messages=[message]))
    assert (err.code, err.param) == ("invalid_value", "messages[0].content[0].type")
    assert f"Unsupported content part type {part['type']!r}" in err.message


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options", "`stream: true`"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"top_logprobs": 5}, "top_logprobs", "`logprobs: true`"),
        ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs", "streaming"),
        ({"tool_choice": "auto"}, "tool_choice", "`tools`"),
        ({"tool_choice": "required", "tools": []}, "tool_choice", "`tools`"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "edit"}}},
            "tool_choice.function.name",
            "'edit'",
        ),
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ],
)
def test_inconsistent_combinations_are_refused(
    fields: dict[str, Any], param: str, needle: str
) -> None:
    err = refused(body(**fields))
    assert (err.code, err.param) == ("invalid_value", param)
    assert needle in err.message


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "none"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "bash"}}},
        {"top_logprobs": 0},
        {"logprobs": True, "top_logprobs": 20},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"prompt_logprobs": 2},
    ],
)
def test_consistent_combinations_pass(fields: dict[str, Any]) -> None:
    validate_request(body(**fields))


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"include_reasoning": False}, "include_reasoning", '"enable_thinking": false'),
        ({"n": 2}, "n", "one completion per call"),
        ({"use_beam_search": True}, "use_beam_search", "beam search"),
        ({"echo": True}, "echo", "did not generate"),
    ],
)
def test_capture_disabling_fields_are_refused(
    fields: dict[str, Any], param: str, needle: str
) -> None:
    err = refused(body(**fields))
    assert (err.code, err.param) == ("capture_disabled", param)
    assert needle in err.message


@pytest.mark.parametrize(
    "fields",
    [
        {"include_reasoning": True},
        {"n": 1},
        {"return_token_ids": False},
        {"logprobs": False},
        {"use_beam_search": False},
        {"echo": False},
        {"return_tokens_as_token_ids": True},
        {"modalities": ["text"]},
        {"chat_template_kwargs": {"enable_thinking": False}},
    ],
)
def test_harmless_settings_of_policy_fields_pass(fields: dict[str, Any]) -> None:
    validate_request(body(**fields))


@pytest.mark.parametrize(
    ("part", "what"),
    [
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
        ({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}, "audio"),
        ({"type": "file", "file": {"file_data": "AAAA", "filename": "a.pdf"}}, "files"),
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video"),
    ],
)
def test_media_the_capture_cannot_store_is_refused_by_name(part: dict[str, Any], what: str) -> None:
    msg = {"role": "user", "content": [{"type": "text", "text": "see"}, part]}
    err = refused(body(messages=[USER, msg]))
    assert (err.code, err.param) == ("unsupported_content", "messages[1].content[1]")
    assert repr(part["type"]) in err.message
    assert what in err.message


def test_audio_output_is_refused() -> None:
    err = refused(body(modalities=["text", "audio"]))
    assert (err.code, err.param) == ("unsupported_content", "modalities")


def test_every_allowed_vllm_extension_passes_together() -> None:
    req = validate_request(
        body(
            top_k=20,
            min_p=0.05,
            repetition_penalty=1.1,
            length_penalty=1.0,
            min_tokens=1,
            stop_token_ids=[2],
            include_stop_str_in_output=False,
            ignore_eos=False,
            skip_special_tokens=False,
            spaces_between_special_tokens=True,
            use_beam_search=False,
            allowed_token_ids=[1, 2],
            bad_words=["x"],
            prompt_logprobs=0,
            truncate_prompt_tokens=-1,
            thinking_token_budget=128,
            echo=False,
            add_generation_prompt=True,
            continue_final_message=False,
            add_special_tokens=False,
            documents=[{"title": "t", "text": "x"}],
            chat_template="{{ messages }}",
            chat_template_kwargs={"enable_thinking": True},
            mm_processor_kwargs={"a": 1},
            media_io_kwargs={"image": {"x": 1}},
            structured_outputs={"regex": "a+", "disable_any_whitespace": True},
            priority=-3,
            request_id="r-1",
            cache_salt="salt",
            include_reasoning=True,
            return_token_ids=True,
            return_tokens_as_token_ids=False,
            routed_experts_prompt_start=17,
            vllm_xargs={"a": 1, "b": ["x", 2.5]},
            kv_transfer_params={"do_remote_prefill": False},
            frequency_penalty=0.1,
            presence_penalty=-0.1,
            logit_bias={"17": -100},
            logprobs=True,
            top_logprobs=3,
            max_completion_tokens=10,
            seed=-1,
            stop="END",
            temperature=1.7,
            top_p=0.9,
            parallel_tool_calls=False,
            user="u",
            reasoning_effort="high",
            metadata={"k": "v"},
            store=False,
            service_tier="auto",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
            },
        )
    )
    assert req.routed_experts_prompt_start == 17
    assert req.structured_outputs is not None
    assert req.structured_outputs.regex == "a+"


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "text"},
        {"type": "json_object"},
        {
            "type": "structural_tag",
            "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}],
            "triggers": ["<a>"],
        },
        {"type": "structural_tag", "format": {"type": "triggered_tags"}},
    ],
)
def test_response_formats(response_format: dict[str, Any]) -> None:
    validate_request(body(response_format=response_format))


def test_nulls_mean_not_sent() -> None:
    fields = {name: None for name in ChatCompletionRequest.__struct_fields__ if name != "messages"}
    req = validate_request({"messages": [USER], **fields})
    assert req.model is None
    assert req.tools is None


def test_validation_does_not_modify_its_input() -> None:
    data = json.loads((VLLM_FIXTURES / "chat-request.json").read_text())
    before = copy.deepcopy(data)
    validate_request(data)
    assert data == before


def test_hostile_names_are_clipped_in_messages() -> None:
    err = refused(body(**{"x" * 5000: 1}))
    assert len(err.message) < 400
    assert err.code == "unknown_field"


def test_deep_nesting_is_refused_with_its_path() -> None:
    deep: Any = "leaf"
    for _ in range(1000):  # orjson decodes up to 1024 levels
        deep = [deep]
    err = refused(body(chat_template_kwargs={"x": deep}))
    assert err.code == "invalid_value"
    assert err.param == "chat_template_kwargs.x" + "[0]" * 63
    assert "deeper than 64 levels" in err.message
    err = refused(body(messages=[{"role": "user", "content": [deep]}]))
    assert err.param == "messages[0].content[0]"


def test_free_json_nesting_up_to_the_limit_passes() -> None:
    nested: Any = {"type": "string"}
    for _ in range(31):  # two levels each: the innermost object is 62 levels down
        nested = {"type": "object", "properties": {"x": nested}}
    tool = {"type": "function", "function": {"name": "t", "parameters": nested}}
    validate_request(body(tools=[tool]))


# Found only at staging time, these would make an answered call `capture_failed`: the digest
# encoding takes int64 integers (orjson decodes integers up to 2**64 - 1).
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "t",
                            "parameters": {"properties": {"n": {"maximum": 2**64 - 1}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters.properties.n.maximum",
        ),
        ({"chat_template_kwargs": {"a": [1, 2, -(2**63) - 1]}}, "chat_template_kwargs.a[2]"),
        ({"vllm_xargs": {"k": 2**63}}, "vllm_xargs.k"),
        ({"kv_transfer_params": {"k": float("inf")}}, "kv_transfer_params.k"),
        (
            {"structured_outputs": {"json": {"maximum": 2**64 - 1}}},
            "structured_outputs.json.maximum",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"m": 2**63}},
                }
            },
            "response_format.json_schema.schema.m",
        ),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"min_tokens": 2**31}, "min_tokens"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_values_the_digest_cannot_encode_are_refused_before_forwarding(
    fields: dict[str, Any], param: str
) -> None:
    err = refused(body(**fields))
    assert (err.code, err.param) == ("invalid_value", param)


def _documented_fields() -> set[str]:
    rows = re.findall(r"^\| `([a-z_]+)` \| (?:OpenAI|vLLM) \|", DOC.read_text(), re.MULTILINE)
    return set(rows)


def test_every_field_is_documented_and_every_documented_field_exists() -> None:
    # Like datasette's documentation check: adding a field without a doc line fails here.
    assert _documented_fields() == set(ChatCompletionRequest.__struct_fields__)


def test_free_json_refuses_what_json_cannot_carry() -> None:
    with pytest.raises(RequestValidationError) as info:
        check_free_json({"a": [{1: "x"}]}, "p")
    assert (info.value.code, info.value.param) == ("invalid_type", "p.a[0]")
    with pytest.raises(RequestValidationError) as info:
        check_free_json({"a": {"b": b"bytes"}}, "p")
    assert (info.value.code, info.value.param) == ("invalid_type", "p.a.b")


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


FREE_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats()
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=200)
@given(value=FREE_JSON)
def test_free_json_check_agrees_with_the_digest_encoding(value: Any) -> None:
    refusal = None
    try:
        check_free_json(value, "v")
    except RequestValidationError as err:
        refusal = err
    if refusal is None:
        encode_value(value)  # accepted values are stageable
        return
    assert refusal.param.startswith("v")
    assert refusal.param in refusal.message
    if _depth(value) <= MAX_FREE_JSON_DEPTH:
        with pytest.raises(EncodingError):
            encode_value(value)
