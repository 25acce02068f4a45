"""Free-form JSON is bounded: bytes per value, JSON values per request (--max-free-json-*).

A refused body gets a 413 naming the value's JSON path, the limit and the setting that raises
it; nothing is forwarded, and the refusal is in the rollout's ledger as ``rejected``. The same
limits hold on the raw body (before decoding) and on a decoded request (the library's path).
"""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from capture_proxy.core.normalize import normalize_request
from capture_proxy.schemas.records import CallStatus
from capture_proxy.schemas.request import (
    FREE_VALUES,
    FreeJsonLimits,
    FreeValueMemo,
    RequestValidationError,
    check_free_json_limits,
)
from tests.support.proxy_harness import chat_body, user

JSON_CT = {"Content-Type": "application/json"}


def _tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Each case: extra request keys, the JSON path the refusal must name, the limit's error code.
_CASES = [
    pytest.param(
        {"chat_template_kwargs": {"x": [7] * 600}},
        "chat_template_kwargs",
        "free_json_too_large",
        id="template-kwargs-bytes",
    ),
    pytest.param(
        {"chat_template_kwargs": {"x": [{}] * 150}},
        "chat_template_kwargs",
        "free_json_too_many_items",
        id="template-kwargs-items",
    ),
    pytest.param(
        {"tools": [_tool("a", {"type": "object"}), _tool("b", {"x": "y" * 2000})]},
        "tools[1].function.parameters",
        "free_json_too_large",
        id="tool-parameters-bytes",
    ),
    pytest.param(
        # Each tool is small: only counted together do they pass the limit.
        {"tools": [_tool(f"t{i}", {"x": [0] * 40}) for i in range(4)]},
        "tools[2].function.parameters",
        "free_json_too_many_items",
        id="tool-parameters-items-summed",
    ),
    pytest.param(
        {"mm_processor_kwargs": {"x": "z" * 1500}},
        "mm_processor_kwargs",
        "free_json_too_large",
        id="mm-processor-kwargs-bytes",
    ),
    pytest.param(
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"x": [[]] * 200}},
            }
        },
        "response_format.json_schema.schema",
        "free_json_too_many_items",
        id="response-format-schema-items",
    ),
    pytest.param(
        {"structured_outputs": {"json": {"x": "q" * 1200}}},
        "structured_outputs.json",
        "free_json_too_large",
        id="structured-outputs-bytes",
    ),
]
_LIMITS = {"max_free_json_bytes": 1000, "max_free_json_items": 100}


@pytest.mark.parametrize(("extra", "param", "code"), _CASES)
async def test_free_form_value_over_a_limit_is_413_named_and_in_the_ledger(
    make_proxy: Any, extra: dict[str, Any], param: str, code: str
) -> None:
    p = await make_proxy(**_LIMITS)
    resp = await p.chat(chat_body(user("hi"), **extra))
    assert resp.status == 413
    err = (await resp.json())["error"]
    assert (err["code"], err["param"]) == (code, param)
    assert param in err["message"]
    setting = "--max-free-json-bytes" if code == "free_json_too_large" else "--max-free-json-items"
    assert setting in err["message"]
    limit = "1000 bytes" if code == "free_json_too_large" else "100 JSON values"
    assert limit in err["message"]
    assert resp.headers["X-Capture-Status"] == "rejected"
    assert p.fake.requests == []
    (entry,) = p.failures()
    assert entry.status is CallStatus.REJECTED
    assert (entry.reason, entry.http_status) == (code, 413)
    assert entry.call_id == resp.headers["X-Capture-Call-Id"]
    assert p.calls() == []


async def test_values_within_the_limits_are_staged(make_proxy: Any) -> None:
    p = await make_proxy(**_LIMITS)
    body = chat_body(
        user("hi"),
        chat_template_kwargs={"enable_thinking": False, "x": list(range(40))},
        tools=[_tool("a", {"type": "object", "properties": {"q": {"type": "string"}}})],
    )
    resp = await p.chat(body)
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Capture-Status"] == "staged"
    (record,) = p.calls()
    assert record.request["chat_template_kwargs"]["x"] == list(range(40))


async def test_a_hostile_body_under_the_body_limit_is_refused_before_decoding(
    make_proxy: Any,
) -> None:
    # 1.4 MiB of short strings: over the default 1 MiB per value, refused from the raw bytes
    # (the body's 100,000 commas are under --max-json-items; tests/server/test_hostile_bodies.py
    # sends bodies of more).
    p = await make_proxy()
    value: dict[str, list[str]] = {"x": ["abcdefghijk"] * 100_000}
    raw = orjson.dumps(chat_body(user("hi"), chat_template_kwargs=value))
    resp = await p.client.post("/r/r1/v1/chat/completions", data=raw, headers=JSON_CT)
    assert resp.status == 413
    err = (await resp.json())["error"]
    assert err["param"] == "chat_template_kwargs"
    assert f"is {len(orjson.dumps(value))} bytes of JSON" in err["message"]
    (entry,) = p.failures()
    assert (entry.status, entry.reason) == (CallStatus.REJECTED, "free_json_too_large")


# -- the checks on their own --------------------------------------------------------------------

_SMALL = FreeJsonLimits(max_bytes=1000, max_items=100)


@pytest.mark.parametrize(("extra", "param", "code"), _CASES)
def test_raw_and_decoded_checks_agree(extra: dict[str, Any], param: str, code: str) -> None:
    body = chat_body(user("hi"), **extra)
    with pytest.raises(RequestValidationError) as raw_err:
        check_free_json_limits(orjson.dumps(body), _SMALL)
    with pytest.raises(RequestValidationError) as decoded_err:
        normalize_request(body, free_json=_SMALL)
    for e in (raw_err.value, decoded_err.value):
        assert (e.param, e.code, e.status) == (param, code, 413)


def test_commas_inside_strings_do_not_count_as_values() -> None:
    # The cheap count over-counts commas in strings; the exact count then decides.
    body = chat_body(user("hi"), chat_template_kwargs={"note": "a," * 400})
    assert check_free_json_limits(orjson.dumps(body), _SMALL) is True
    normalize_request(body, free_json=_SMALL)


def test_a_value_of_the_wrong_shape_is_bounded_as_a_whole() -> None:
    # `tools` is not a list of tools: the schema refuses it later, but its size is bounded now.
    body = chat_body(user("hi"), tools={"x": "y" * 2000})
    with pytest.raises(RequestValidationError) as e:
        check_free_json_limits(orjson.dumps(body), _SMALL)
    assert (e.value.param, e.value.code) == ("tools", "free_json_too_large")


def test_not_json_and_not_an_object() -> None:
    assert check_free_json_limits(b"{not json", _SMALL) is False
    with pytest.raises(RequestValidationError) as e:
        check_free_json_limits(b"[1, 2]", _SMALL)
    assert (e.value.param, e.value.code, e.value.status) == ("", "invalid_type", 422)


async def test_a_large_body_that_is_not_json_is_400_without_decoding(make_proxy: Any) -> None:
    p = await make_proxy()
    raw = b'{"messages": [{"role": "user", "content": "' + b"x" * 2_000_000 + b'"}, oops'
    resp = await p.client.post("/r/r1/v1/chat/completions", data=raw, headers=JSON_CT)
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_json"
    (entry,) = p.failures()
    assert (entry.status, entry.reason) == (CallStatus.REJECTED, "invalid_json")


def test_the_defaults_take_an_agents_tools() -> None:
    # 128 tools with 30-property schemas: well inside the defaults.
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(30)},
        "required": ["p0"],
    }
    body = chat_body(user("hi"), tools=[_tool(f"t{i}", schema) for i in range(128)])
    assert check_free_json_limits(orjson.dumps(body), FreeJsonLimits()) is True
    normalize_request(body)


def _schema(pad: int, **extra: Any) -> dict[str, Any]:
    """A tool schema of a few hundred bytes of JSON (worth remembering: `FreeValueMemo`)."""
    return {"type": "object", "description": "d" * pad, **extra}


def test_a_tool_schema_checked_before_gets_the_same_verdict() -> None:
    # Re-sent schemas are not walked again: their remembered count must refuse exactly as a
    # walk would, under whatever limits the next request is checked against.
    tools = [_tool(f"t{i}", _schema(300, p=[0] * 30)) for i in range(4)]
    body = chat_body(user("hi"), tools=tools)
    normalize_request(body)  # remembered under the defaults
    assert FREE_VALUES.key(tools[0]["function"]["parameters"]) is not None
    for _ in range(2):
        with pytest.raises(RequestValidationError) as e:
            normalize_request(body, free_json=_SMALL)
        assert (e.value.param, e.value.code) == (
            "tools[2].function.parameters",
            "free_json_too_many_items",
        )


def test_a_nan_is_refused_after_the_same_value_with_null_passed() -> None:
    # orjson writes NaN as null: a value with a null is never remembered, so its NaN twin is
    # still walked (the library's path takes Python values, which may hold a NaN).
    ok = _schema(300, default=None)
    normalize_request(chat_body(user("hi"), tools=[_tool("t", ok)]))
    assert FREE_VALUES.key(ok) is None
    with pytest.raises(RequestValidationError) as e:
        normalize_request(chat_body(user("hi"), tools=[_tool("t", _schema(300, default=math.nan))]))
    assert e.value.code == "invalid_value"
    assert "not finite" in e.value.message


def test_values_orjson_cannot_write_exactly_are_never_keys() -> None:
    class Sub(dict[str, Any]):
        pass

    assert FREE_VALUES.key(Sub(_schema(300))) is None  # a subclass: walked every time
    assert FREE_VALUES.key({1: "x" * 300}) is None  # a non-string key
    assert FREE_VALUES.key(_schema(300, n=2**70)) is None  # beyond 64 bits
    assert FREE_VALUES.key(_schema(10)) is None  # small: cheaper to walk


def test_the_memo_is_bounded_by_its_keys_bytes() -> None:
    memo = FreeValueMemo(max_bytes=4000, min_bytes=10)
    keys = []
    for i in range(20):
        k = memo.key(_schema(300, i=i))
        assert k is not None
        keys.append(k)
        memo.put(k, 3)
        assert memo.bytes <= 4000
    assert 0 < len(memo) < 20
    assert memo.get(keys[-1]) == 3
    assert memo.key(_schema(1200)) is None  # over a quarter of the bound: never kept
