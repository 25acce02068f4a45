"""The control API refuses a bad body the way the chat route refuses a bad request.

Same status, same OpenAI-style body, ``param`` the JSON path of the offending value, and a message
that names that path in the chat route's words, although one validates with pydantic and the
other with msgspec.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.proxy_harness import chat_body, user

JSON_CT = {"Content-Type": "application/json"}

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


async def _post(p: Any, path: str, body: bytes, method: str = "POST") -> tuple[int, Any]:
    resp = await p.client.request(method, path, data=body, headers=ADMIN)
    return resp.status, await resp.json()


async def _chat(p: Any, body: bytes) -> tuple[int, Any]:
    resp = await p.client.post("/r/r1/v1/chat/completions", data=body, headers=JSON_CT)
    return resp.status, await resp.json()


def _error(message: str, param: str, code: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


async def test_an_unknown_key_is_named_with_the_fields_allowed(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    status, body = await _post(p, "/admin/rollouts", b'{"rolout_id": "ep-1"}')
    assert status == 422
    assert body == _error(
        "Unknown field `rolout_id` at the top level of the request body; "
        "allowed fields: rollout_id, policy, metadata, token_in",
        "rolout_id",
        "unknown_field",
    )
    # The chat route words the same mistake the same way.
    status, chat = await _chat(
        p, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "rolout_id": "ep-1"}'
    )
    assert status == 422
    assert chat["error"]["param"] == "rolout_id"
    assert chat["error"]["code"] == "unknown_field"
    assert chat["error"]["message"].startswith(
        "Unknown field `rolout_id` at the top level of the request body; "
    )
    assert p.failures("ep-1") == []  # nothing was created


@pytest.mark.parametrize(
    ("path", "method", "sent", "message", "param"),
    [
        (
            "/admin/weight-version",
            "PUT",
            b'{"weight_version": "3"}',
            "Expected `int`, got `str` at weight_version",
            "weight_version",
        ),
        (
            "/admin/weight-version",
            "PUT",
            b'{"weight_version": true}',
            "Expected `int`, got `bool` at weight_version",
            "weight_version",
        ),
        (
            "/admin/rollouts",
            "POST",
            b'{"rollout_id": 7}',
            "Expected `str | null`, got `int` at rollout_id",
            "rollout_id",
        ),
        (
            "/admin/rollouts",
            "POST",
            b'{"metadata": ["task", 7]}',
            "Expected `object`, got `array` at metadata",
            "metadata",
        ),
    ],
)
async def test_a_wrong_type_names_the_path_and_both_types(
    make_proxy: Any, path: str, method: str, sent: bytes, message: str, param: str
) -> None:
    p = await make_proxy(admin_token=TOKEN)
    status, body = await _post(p, path, sent, method)
    assert status == 422
    assert body == _error(message, param, "invalid_type")


async def test_a_wrong_type_reads_as_on_the_chat_route(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    one = b'"messages": [{"role": "user", "content": "x"}]'
    # A required field, then an optional one: both routes add `| null` for the latter.
    _, control = await _post(p, "/admin/weight-version", b'{"weight_version": "3"}', "PUT")
    _, chat = await _chat(p, b'{"model": "m", "messages": "hi"}')
    assert control["error"]["message"] == "Expected `int`, got `str` at weight_version"
    assert chat["error"]["message"] == "Expected `array`, got `str` at messages"
    _, control = await _post(p, "/admin/rollouts", b'{"rollout_id": 7}')
    _, chat = await _chat(p, b'{"model": "m", "max_tokens": "3", %s}' % one)
    assert control["error"]["message"] == "Expected `str | null`, got `int` at rollout_id"
    assert chat["error"]["message"] == "Expected `int | null`, got `str` at max_tokens"
    assert chat["error"]["code"] == control["error"]["code"] == "invalid_type"


async def test_a_policy_value_is_named_by_its_path_in_the_body(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    sent = b'{"rollout_id": "ep", "policy": {"temperature": "hot"}}'
    status, body = await _post(p, "/admin/rollouts", sent)
    assert status == 422
    assert body["error"]["param"] == "policy.temperature"
    assert body["error"]["code"] == "invalid_policy"
    assert body["error"]["message"].endswith("got `str` at policy.temperature")
    status, body = await _post(p, "/admin/rollouts", b'{"rollout_id": "ep", "policy": {"n": 3}}')
    assert status == 422
    assert body["error"]["param"] == "policy.n"
    assert body["error"]["message"].startswith(
        "Unknown field `n` at policy.n; a policy may set only: chat_template_kwargs, "
    )
    # Neither refused rollout was created.
    status, _ = await _post(p, "/admin/rollouts", b'{"rollout_id": "ep"}')
    assert status == 201


async def test_a_too_long_rollout_id_says_the_limit(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    status, body = await _post(p, "/admin/rollouts", b'{"rollout_id": "%s"}' % (b"a" * 129))
    assert status == 422
    assert body == _error(
        "Expected `str` of length <= 128 at rollout_id", "rollout_id", "invalid_value"
    )
    status, body = await _post(p, "/admin/rollouts", b'{"rollout_id": ""}')
    assert status == 422
    assert body == _error(
        "Expected `str` of length >= 1 at rollout_id", "rollout_id", "invalid_value"
    )


async def test_a_rollout_id_with_other_characters_is_refused_naming_them(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    status, body = await _post(p, "/admin/rollouts", b'{"rollout_id": "a/b"}')
    assert status == 422
    assert body == _error(
        "Invalid value 'a/b' at rollout_id; a rollout id is 1-128 characters of [A-Za-z0-9._:-]",
        "rollout_id",
        "invalid_rollout_id",
    )


async def test_bounds_and_missing_fields_are_named(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    status, body = await _post(p, "/admin/weight-version", b'{"weight_version": -1}', "PUT")
    assert status == 422
    assert body == _error(
        "Expected `int` >= 0 at weight_version", "weight_version", "invalid_value"
    )
    status, body = await _post(p, "/admin/weight-version", b"{}", "PUT")
    assert status == 422
    assert body == _error(
        "Missing required field `weight_version` at weight_version",
        "weight_version",
        "missing_field",
    )


async def test_a_body_that_is_not_json_is_a_400_as_on_the_chat_route(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    status, control = await _post(p, "/admin/rollouts", b'{"rollout_id": ')
    assert status == 400
    assert control["error"]["code"] == "invalid_json"
    assert control["error"]["type"] == "invalid_request_error"
    assert control["error"]["message"].startswith("request body is not valid JSON: ")
    status, chat = await _chat(p, b'{"model": ')
    assert status == 400
    assert chat["error"]["code"] == control["error"]["code"]


@pytest.mark.parametrize(("sent", "got"), [(b"[]", "array"), (b'"ep-1"', "str"), (b"null", "null")])
async def test_a_body_that_is_not_an_object_is_refused_as_a_whole(
    make_proxy: Any, sent: bytes, got: str
) -> None:
    p = await make_proxy(admin_token=TOKEN)
    status, control = await _post(p, "/admin/rollouts", sent)
    assert status == 422
    assert control == _error(
        f"The request body must be a JSON object, got `{got}`", "", "invalid_type"
    )
    status, chat = await _chat(p, sent)
    assert (status, chat) == (422, control)


async def test_an_empty_body_is_an_empty_object(make_proxy: Any) -> None:
    # A driver may POST nothing to create a rollout with a generated id.
    p = await make_proxy(admin_token=TOKEN)
    status, body = await _post(p, "/admin/rollouts", b"")
    assert status == 201
    assert body["rollout_id"].startswith("ro-")
    assert (await p.chat(chat_body(user("x")), rollout=body["rollout_id"])).status == 200
