"""Request normalization: reasoning renamed, images made attachments, nothing else touched."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_proxy.core.normalize import NormalizedRequest, normalize_request
from capture_proxy.schemas.attachments import iter_attachment_refs
from capture_proxy.schemas.digest import encode_value
from capture_proxy.schemas.request import RequestValidationError
from capture_proxy.schemas.request._messages import AssistantMessage
from tests.support import FIXTURES

VLLM_FIXTURES = FIXTURES / "vllm-0.32.0"
OPENCODE_FIXTURES = FIXTURES / "opencode-1.18.33"

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3
JPEG = b"\xff\xd8\xff\xe0" + b"\x10JFIF" * 50
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
JPEG_URL = "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()

# -- OpenCode 1.18.33 request shapes (docs/upstream-facts.md) -------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Executes a given bash command",
            "parameters": {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command to execute"},
                    "timeout": {"type": "number"},
                    "description": {"type": "string"},
                },
                "required": ["command", "description"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Reads a file",
            "parameters": {
                "type": "object",
                "properties": {"filePath": {"type": "string"}},
                "required": ["filePath"],
            },
        },
    },
]
SYSTEM = [
    {"role": "system", "content": "You are opencode, an interactive CLI tool."},
    {"role": "system", "content": "Here is some useful information about the environment..."},
]
# Every key of the model's `options` is copied to the top level of the body.
PROVIDER_OPTIONS = {"chat_template_kwargs": {"enable_thinking": True}, "top_k": 20}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
TOOL_CALL = {
    "id": "call_0a1b",
    "type": "function",
    "function": {"name": "bash", "arguments": '{"command":"ls","description":"List files"}'},
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_0a1b", "content": "a.txt\nb.txt\n"}


def opencode_title_call() -> dict[str, Any]:
    return {
        "model": "policy",
        "max_tokens": 32000,
        "reasoning_effort": "low",
        "messages": [
            {"role": "system", "content": "You are a title generator. You output ONLY a title."},
            {"role": "user", "content": "Generate a title for this conversation:\n"},
            {"role": "user", "content": "List the files here."},
        ],
        **PROVIDER_OPTIONS,
        **STREAM,
    }


def opencode_agent_call(*history: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "policy",
        "max_tokens": 32000,
        "messages": [*SYSTEM, {"role": "user", "content": "List the files here."}, *history],
        "tools": TOOLS,
        "tool_choice": "auto",
        **PROVIDER_OPTIONS,
        **STREAM,
    }


def assistant_turn(field: str, text: str = "I should run ls.") -> dict[str, Any]:
    return {"role": "assistant", "content": "", field: text, "tool_calls": [TOOL_CALL]}


def image_message(*urls: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What is in this image?"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"role": "user", "content": parts}


def refused(data: Any, **kwargs: Any) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as info:
        normalize_request(data, **kwargs)
    assert info.value.param in info.value.message  # docs/contract.md: the message names the path
    return info.value


def _bodies(paths: list[Path]) -> list[tuple[str, Any]]:
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        # Tolerate a capture that wraps the body ({"body": {...}, "headers": ...}).
        if isinstance(data, dict) and "messages" not in data and isinstance(data.get("body"), dict):
            data = data["body"]
        out.append((path.name, data))
    return out


@pytest.mark.parametrize(
    "data",
    [
        opencode_title_call(),
        opencode_agent_call(),
        opencode_agent_call(assistant_turn("reasoning"), TOOL_RESULT),
        opencode_agent_call(assistant_turn("reasoning_content"), TOOL_RESULT),
        opencode_agent_call(
            assistant_turn("reasoning"),
            TOOL_RESULT,
            {"role": "assistant", "content": "Two files.", "reasoning": "done"},
            {"role": "user", "content": "thanks"},
        ),
        opencode_agent_call(image_message(PNG_URL)),
    ],
    ids=["title", "first", "interleaved", "reasoning_content", "two-turns", "image"],
)
def test_opencode_request_shapes_pass(data: dict[str, Any]) -> None:
    before = copy.deepcopy(data)
    n = normalize_request(data)
    assert isinstance(n, NormalizedRequest)
    assert data == before  # the caller's body is never modified
    assert n.request.stream is True
    assert n.request.max_tokens == 32000
    assert n.body["chat_template_kwargs"] == {"enable_thinking": True}
    for message in n.body["messages"]:
        assert "reasoning" not in message


@pytest.mark.parametrize(
    ("name", "data"),
    _bodies(sorted(VLLM_FIXTURES.glob("*-request.json")))
    + _bodies(sorted(OPENCODE_FIXTURES.glob("*.json"))),
)
def test_captured_requests_normalize(name: str, data: Any) -> None:
    n = normalize_request(data)
    assert len(n.request.messages) == len(data["messages"])
    assert set(n.staged) == set(data)


# -- reasoning ------------------------------------------------------------------------------------


def test_reasoning_becomes_reasoning_content() -> None:
    data = opencode_agent_call(assistant_turn("reasoning", "think"), TOOL_RESULT)
    n = normalize_request(data)
    replayed = n.body["messages"][3]
    assert replayed["reasoning_content"] == "think"
    assert "reasoning" not in replayed
    assert replayed["tool_calls"] == [TOOL_CALL]
    typed = n.request.messages[3]
    assert isinstance(typed, AssistantMessage)
    assert typed.reasoning_content == "think"
    assert "reasoning" in data["messages"][3]  # the input is left as it was


def test_only_changed_messages_are_copied() -> None:
    data = opencode_agent_call(assistant_turn("reasoning"), TOOL_RESULT)
    n = normalize_request(data)
    assert n.body is not data
    assert n.body["messages"] is not data["messages"]
    for i in (0, 1, 2, 4):
        assert n.body["messages"][i] is data["messages"][i]
    assert n.body["messages"][3] is not data["messages"][3]
    assert n.body["tools"] is data["tools"]
    assert n.staged is n.body  # no images: nothing to stage differently
    assert n.attachments == {}


def test_a_body_with_nothing_to_normalize_is_not_copied() -> None:
    data = opencode_agent_call(assistant_turn("reasoning_content"), TOOL_RESULT)
    n = normalize_request(data)
    assert n.body is data
    assert n.staged is data


@pytest.mark.parametrize(
    ("reasoning", "reasoning_content", "expected"),
    [
        ("same", "same", "same"),
        (None, "kept", "kept"),
        ("moved", None, "moved"),
        (None, None, None),
        ("", None, ""),
    ],
)
def test_both_fields_present(
    reasoning: str | None, reasoning_content: str | None, expected: str | None
) -> None:
    message = {"role": "assistant", "content": "x", "reasoning": reasoning}
    message["reasoning_content"] = reasoning_content
    n = normalize_request(opencode_agent_call(message))
    out = n.body["messages"][3]
    assert out == {"role": "assistant", "content": "x", "reasoning_content": expected}


def test_different_reasoning_texts_are_a_conflict() -> None:
    message = {"role": "assistant", "content": "", "reasoning": "a", "reasoning_content": "b"}
    err = refused(opencode_agent_call(TOOL_RESULT | {"tool_call_id": "x"}, message))
    assert (err.code, err.param, err.status) == ("reasoning_conflict", "messages[4].reasoning", 422)
    assert "messages[4].reasoning" in err.message


@pytest.mark.parametrize(
    ("message", "param", "got"),
    [
        ({"reasoning": ["a"]}, "messages[3].reasoning", "array"),
        ({"reasoning": 1, "reasoning_content": "a"}, "messages[3].reasoning", "int"),
        (
            {"reasoning": "a", "reasoning_content": {"t": "a"}},
            "messages[3].reasoning_content",
            "object",
        ),
    ],
)
def test_non_string_reasoning_is_reported_under_its_own_name(
    message: dict[str, Any], param: str, got: str
) -> None:
    err = refused(opencode_agent_call({"role": "assistant", "content": "", **message}))
    assert (err.code, err.param) == ("invalid_type", param)
    assert f"got `{got}` at {param}" in err.message


def test_reasoning_on_other_roles_is_an_unknown_field() -> None:
    err = refused(opencode_agent_call({"role": "user", "content": "x", "reasoning": "r"}))
    assert (err.code, err.param) == ("unknown_field", "messages[3].reasoning")


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"messages": "not a list"}, "messages"),
        ({"messages": [["assistant"]]}, "messages[0]"),
        ({"messages": [{"role": ["assistant"], "reasoning": 1}]}, "messages[0].role"),
        ({"messages": [{"reasoning": "r"}]}, "messages[0].role"),
        ({"messages": None}, "messages"),
        ({}, "messages"),
    ],
)
def test_malformed_shapes_are_left_to_validation(data: Any, param: str) -> None:
    assert refused(data).param == param


@pytest.mark.parametrize("data", [[], "body", 0, None])
def test_body_must_be_an_object(data: Any) -> None:
    err = refused(data)
    assert (err.param, err.code) == ("", "invalid_type")


# -- images ---------------------------------------------------------------------------------------


def test_data_url_image_becomes_an_attachment() -> None:
    data = opencode_agent_call(image_message(PNG_URL))
    n = normalize_request(data)
    sha = hashlib.sha256(PNG).hexdigest()
    assert list(n.attachments) == [sha]
    att = n.attachments[sha]
    assert (att.sha256, att.media_type, att.data) == (sha, "image/png", PNG)
    assert att.check()
    # Forwarded: the data URL, untouched. Staged: a reference, and no base64 anywhere.
    assert n.body["messages"][3]["content"][1]["image_url"]["url"] == PNG_URL
    assert n.staged["messages"][3]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": f"attachment:sha256:{sha}"},
    }
    assert b"base64" not in orjson.dumps(n.staged)
    assert list(iter_attachment_refs(n.staged)) == [sha]


def test_staged_copy_shares_everything_but_the_image_message() -> None:
    data = opencode_agent_call(image_message(PNG_URL), assistant_turn("reasoning_content"))
    n = normalize_request(data)
    assert n.body is data  # nothing to rename
    assert n.staged is not n.body
    for i in (0, 1, 2, 4):
        assert n.staged["messages"][i] is n.body["messages"][i]
    image_msg = n.staged["messages"][3]
    assert image_msg is not n.body["messages"][3]
    assert image_msg["content"][0] is n.body["messages"][3]["content"][0]  # the text part
    assert n.staged["tools"] is n.body["tools"]


def test_detail_and_part_keys_are_kept_in_the_staged_copy() -> None:
    part = {"type": "image_url", "image_url": {"url": JPEG_URL, "detail": "high"}}
    n = normalize_request(opencode_agent_call({"role": "user", "content": [part]}))
    sha = hashlib.sha256(JPEG).hexdigest()
    staged = n.staged["messages"][3]["content"][0]
    assert staged == {
        "type": "image_url",
        "image_url": {"url": f"attachment:sha256:{sha}", "detail": "high"},
    }
    assert n.attachments[sha].media_type == "image/jpeg"


def test_the_same_image_twice_is_one_attachment() -> None:
    # OpenCode re-sends the image on every later call of a session.
    data = opencode_agent_call(
        image_message(PNG_URL),
        assistant_turn("reasoning"),
        TOOL_RESULT,
        image_message(PNG_URL, JPEG_URL),
    )
    n = normalize_request(data)
    png, jpeg = hashlib.sha256(PNG).hexdigest(), hashlib.sha256(JPEG).hexdigest()
    assert set(n.attachments) == {png, jpeg}
    assert list(iter_attachment_refs(n.staged)) == [png, png, jpeg]
    assert b"base64" not in orjson.dumps(n.staged)
    assert n.body["messages"][4]["reasoning_content"] == "I should run ls."
    assert n.staged["messages"][4] is n.body["messages"][4]


def test_media_type_is_lowercased_and_parameters_are_allowed() -> None:
    url = "DATA:Image/PNG;name=a.png;base64," + base64.b64encode(PNG).decode()
    n = normalize_request(opencode_agent_call(image_message(url)))
    assert next(iter(n.attachments.values())).media_type == "image/png"


IMAGE_PARAM = "messages[3].content[1].image_url.url"


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,iVBORw0KGgo=!",  # outside the alphabet
        "data:image/png;base64,iVBORw0KGgo",  # missing padding
        "data:image/png;base64,iVBO Rw0KGgo=",  # whitespace
        "data:image/png;base64,iVBORw0K\nGgo=",
        "data:image/png;base64,ïVBORw0KGgo=",  # not ASCII
        "data:image/png;base64,A",
    ],
)
def test_invalid_base64_is_refused(url: str) -> None:
    err = refused(opencode_agent_call(image_message(url)))
    assert (err.code, err.param, err.status) == ("invalid_image", IMAGE_PARAM, 422)
    assert "base64" in err.message
    assert IMAGE_PARAM in err.message


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("data:text/plain;base64,aGVsbG8=", "'text/plain'"),
        ("data:application/pdf;base64,aGVsbG8=", "'application/pdf'"),
        ("data:image/png,rawbytes", "expected data:image/<type>;base64"),
        ("data:;base64,aGVsbG8=", "expected data:image/<type>;base64"),
        ("data:image/png;base64,", "empty"),
    ],
)
def test_non_image_or_malformed_data_urls_are_refused(url: str, needle: str) -> None:
    err = refused(opencode_agent_call(image_message(url)))
    assert (err.code, err.param) == ("invalid_image", IMAGE_PARAM)
    assert needle in err.message


@pytest.mark.parametrize(
    "url", ["https://example.com/cat.png", "http://10.0.0.1/x.png", "file:///etc/passwd", "cat.png"]
)
def test_remote_urls_are_refused_by_default(url: str) -> None:
    err = refused(opencode_agent_call(image_message(url)))
    assert (err.code, err.param) == ("remote_media_refused", IMAGE_PARAM)
    assert "does not fetch" in err.message


def test_remote_urls_pass_through_when_allowed() -> None:
    url = "https://example.com/cat.png"
    data = opencode_agent_call(image_message(url, PNG_URL))
    n = normalize_request(data, allow_remote_media=True)
    assert n.body["messages"][3]["content"][1]["image_url"]["url"] == url
    assert n.staged["messages"][3]["content"][1]["image_url"]["url"] == url
    assert list(n.attachments) == [hashlib.sha256(PNG).hexdigest()]  # only the inline one


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://host/x.png", "attachment:sha256:00"])
def test_only_http_urls_even_when_remote_media_is_allowed(url: str) -> None:
    err = refused(opencode_agent_call(image_message(url)), allow_remote_media=True)
    assert (err.code, err.param) == ("invalid_value", IMAGE_PARAM)


def test_oversized_image_is_413_before_and_after_decoding() -> None:
    data = opencode_agent_call(image_message(PNG_URL))
    err = refused(data, max_attachment_bytes=100)  # refused from the encoded length
    assert (err.code, err.param, err.status) == ("attachment_too_large", IMAGE_PARAM, 413)
    err = refused(data, max_attachment_bytes=len(PNG) - 1)  # refused from the decoded length
    assert (err.code, err.status) == ("attachment_too_large", 413)
    assert normalize_request(data, max_attachment_bytes=len(PNG)).attachments


def test_validation_comes_before_image_decoding() -> None:
    # A bad image in a body that is invalid anyway reports the schema problem first.
    data = opencode_agent_call(image_message("data:image/png;base64,!!"))
    data["bogus"] = 1
    assert refused(data).param == "bogus"


# -- properties -----------------------------------------------------------------------------------

JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=30,
)
SMALL_JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)

FIELD_NAMES = st.sampled_from(
    ["model", "messages", "stream", "stream_options", "tools", "tool_choice", "n", "max_tokens",
     "logprobs", "top_logprobs", "include_reasoning", "echo", "temperature", "thinking_trace"]
)  # fmt: skip
URLS = st.sampled_from(
    [PNG_URL, JPEG_URL, "data:image/png;base64,!!", "data:text/plain;base64,QQ==",
     "https://x/y.png", "data:image/png;base64,", "data:image/gif;base64,R0lGODlh"]
)  # fmt: skip
IMAGE_PARTS = st.fixed_dictionaries(
    {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": URLS})}
)
OTHER_PARTS = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "x"]), "text": SMALL_JSON}
)
MESSAGE_KEYS = st.sampled_from(
    ["role", "content", "reasoning", "reasoning_content", "tool_calls", "tool_call_id", "name"]
)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function"])
MESSAGES = st.dictionaries(
    MESSAGE_KEYS,
    ROLES | st.lists(IMAGE_PARTS | OTHER_PARTS | SMALL_JSON, max_size=3) | SMALL_JSON,
    max_size=5,
)
REQUEST_LIKE = st.dictionaries(FIELD_NAMES, st.lists(MESSAGES, max_size=4) | SMALL_JSON, max_size=6)


# Near-valid requests: OpenCode-like bodies, then (usually) one random edit somewhere in the tree,
# so that the success path, the image path and every refusal are all reached.
TEXTS = st.sampled_from(["", "think", "other", "List the files."])
ASSISTANTS = st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": st.sampled_from(["", "ok", None])},
    optional={
        "reasoning": TEXTS | st.none(),
        "reasoning_content": TEXTS | st.none(),
        "tool_calls": st.just([TOOL_CALL]),
    },
)
USERS = st.fixed_dictionaries(
    {
        "role": st.just("user"),
        "content": TEXTS
        | st.lists(IMAGE_PARTS | st.just({"type": "text", "text": "hi"}), min_size=1, max_size=3),
    }
)
NEAR_VALID_MESSAGES = st.lists(
    st.sampled_from([*SYSTEM, TOOL_RESULT]) | USERS | ASSISTANTS, min_size=1, max_size=5
)
NEAR_VALID = st.fixed_dictionaries(
    {"model": st.just("policy"), "messages": NEAR_VALID_MESSAGES},
    optional={
        "tools": st.just(TOOLS),
        "tool_choice": st.sampled_from(["auto", "none"]),
        "stream": st.booleans(),
        "max_tokens": st.integers(0, 32000),
        "n": st.integers(0, 3),
        "include_reasoning": st.booleans(),
        "chat_template_kwargs": SMALL_JSON,
    },
)
EDIT_KEYS = MESSAGE_KEYS | FIELD_NAMES | st.sampled_from(["image_url", "url", "type", "text"])


def _containers(value: Any, out: list[Any]) -> list[Any]:
    if isinstance(value, dict | list):
        out.append(value)
        for child in value.values() if isinstance(value, dict) else value:
            _containers(child, out)
    return out


@st.composite
def near_valid_requests(draw: st.DrawFn) -> dict[str, Any]:
    data = copy.deepcopy(draw(NEAR_VALID))
    for _ in range(draw(st.integers(0, 2))):
        target = draw(st.sampled_from(_containers(data, [])))
        value = draw(SMALL_JSON | URLS | ROLES)
        if isinstance(target, dict):
            target[draw(EDIT_KEYS)] = value
        elif target:
            target[draw(st.integers(0, len(target) - 1))] = value
    return data


def _normalize_or_refuse(data: Any, allow_remote_media: bool) -> NormalizedRequest | None:
    """The normalized request, or None when refused; any other exception fails the test."""
    try:
        return normalize_request(data, allow_remote_media=allow_remote_media)
    except RequestValidationError as err:
        refusal = err
    assert refusal.code
    assert refusal.status in (413, 422)
    assert refusal.param in refusal.message
    return None


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(data=JSON_VALUES, allow_remote_media=st.booleans())
def test_arbitrary_json_only_ever_raises_request_validation_error(
    data: Any, allow_remote_media: bool
) -> None:
    _normalize_or_refuse(data, allow_remote_media)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(data=REQUEST_LIKE | near_valid_requests(), allow_remote_media=st.booleans())
def test_request_like_json_only_ever_raises_request_validation_error(
    data: dict[str, Any], allow_remote_media: bool
) -> None:
    before = copy.deepcopy(data)
    n = _normalize_or_refuse(data, allow_remote_media)
    assert data == before
    if n is not None:
        staged_urls = _image_urls(n.staged)
        assert not [url for url in staged_urls if url.lower().startswith("data:")]
        assert len(staged_urls) == len(_image_urls(n.body))
        assert set(iter_attachment_refs(n.staged)) == set(n.attachments)
        assert all(att.check() for att in n.attachments.values())
        # What is accepted can be staged: the digest encoding takes every value of it.
        assert encode_value(n.staged, field="request")


def _image_urls(request: dict[str, Any]) -> list[str]:
    return [
        part["image_url"]["url"]
        for message in request["messages"]
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image_url"
    ]


@settings(max_examples=50)
@given(images=st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=4))
def test_attachments_are_exactly_the_inline_images(images: list[bytes]) -> None:
    urls = ["data:image/webp;base64," + base64.b64encode(b).decode() for b in images]
    n = normalize_request(opencode_agent_call(image_message(*urls)))
    assert n.attachments.keys() == {hashlib.sha256(b).hexdigest() for b in images}
    for att in n.attachments.values():
        assert att.check()
    assert [a for a in iter_attachment_refs(n.staged)] == [
        hashlib.sha256(b).hexdigest() for b in images
    ]
    assert [p["image_url"]["url"] for p in n.body["messages"][3]["content"][1:]] == urls


def test_deeply_nested_bodies_are_refused_not_crashed() -> None:
    deep: Any = {}
    for _ in range(10_000):
        deep = {"messages": [deep]}
    err = refused(deep)
    assert err.param.startswith("messages[0]")
