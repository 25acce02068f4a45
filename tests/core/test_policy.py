"""The training request policy: each knob's effect on the forwarded request and on the record."""

from __future__ import annotations

from typing import Any

import pytest

from capture_proxy.core.policy import PolicyError, RequestPolicy
from tests.support.proxy_harness import chat_body, user

TOKEN = "t"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def test_precedence_client_defaults_rollout_force() -> None:
    policy = RequestPolicy(
        defaults={
            "temperature": 0.7,
            "top_p": 0.9,
            "chat_template_kwargs": {"enable_thinking": True, "a": 1},
        },
        force={"seed": 7, "chat_template_kwargs": {"a": 3}},
    )
    client = {
        "model": "m",
        "messages": [],
        "temperature": 0.2,
        "chat_template_kwargs": {"a": 2, "b": 2},
    }
    out = policy.apply(client, rollout={"top_p": 0.5, "temperature": 1.0})
    assert out["temperature"] == 1.0  # rollout policy beats the client
    assert out["top_p"] == 0.5  # rollout policy beats the operator default
    assert out["seed"] == 7  # forced
    # merged key by key: default < client < forced
    assert out["chat_template_kwargs"] == {"enable_thinking": True, "a": 3, "b": 2}
    assert client["temperature"] == 0.2
    assert "seed" not in client


def test_defaults_fill_only_what_the_client_left_out() -> None:
    policy = RequestPolicy(defaults={"temperature": 0.7})
    assert policy.apply({"temperature": 0.1})["temperature"] == 0.1
    assert policy.apply({})["temperature"] == 0.7


def test_forced_values_beat_the_rollout_policy() -> None:
    policy = RequestPolicy(force={"temperature": 1.0})
    assert policy.apply({"temperature": 0.1}, rollout={"temperature": 0.5})["temperature"] == 1.0


def test_max_tokens_cap_and_model_override() -> None:
    policy = RequestPolicy(max_tokens_cap=100, model="policy")
    assert policy.apply({"model": "x", "max_tokens": 32000}) == {
        "model": "policy",
        "max_tokens": 100,
    }
    assert policy.apply({"max_completion_tokens": 50})["max_completion_tokens"] == 50
    assert policy.apply({})["max_tokens"] == 100


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"defaults": {"n": 2}}, "policy_defaults.n is not a policy parameter"),
        ({"force": {"temperature": "hot"}}, "policy_force.temperature"),
        ({"force": {"top_k": 1.5}}, "policy_force.top_k"),
    ],
)
def test_invalid_policy_is_refused_naming_the_key(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        RequestPolicy(**kwargs)


async def test_effective_request_is_forwarded_and_recorded(make_proxy: Any) -> None:
    p = await make_proxy(
        policy_defaults={"temperature": 0.6, "chat_template_kwargs": {"enable_thinking": True}},
        policy_force={"seed": 11},
        max_tokens_cap=64,
        admin_token=TOKEN,
    )
    created = await p.client.post(
        "/admin/rollouts", json={"rollout_id": "ep", "policy": {"top_p": 0.8}}, headers=ADMIN
    )
    assert created.status == 201
    resp = await p.chat(chat_body(user("x"), max_tokens=32000, seed=1), rollout="ep")
    assert resp.headers["X-Capture-Status"] == "staged"
    sent = p.fake.requests[0]
    expected = {
        "temperature": 0.6,
        "top_p": 0.8,
        "seed": 11,
        "max_tokens": 64,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    for key, value in expected.items():
        assert sent[key] == value, key
    (record,) = p.calls("ep")
    for key, value in expected.items():
        assert record.sampling[key] == value, key
        assert record.request[key] == value, key
    # The digest covers the sampling parameters: the record verifies as staged.
    from capture_proxy.schemas.digest import verify_record

    verify_record(record)


async def test_rollout_policy_is_validated_at_creation(make_proxy: Any) -> None:
    p = await make_proxy(admin_token=TOKEN)
    bad = await p.client.post(
        "/admin/rollouts", json={"rollout_id": "ep", "policy": {"n": 3}}, headers=ADMIN
    )
    assert bad.status == 422
    assert (await bad.json())["error"]["code"] == "invalid_policy"
    ok = await p.client.post("/admin/rollouts", json={"rollout_id": "ep"}, headers=ADMIN)
    assert ok.status == 201  # the refused rollout left nothing behind


@pytest.mark.parametrize("overflow", ["error", "cap"])
async def test_context_guard(make_proxy: Any, overflow: str) -> None:
    p = await make_proxy(max_model_len=200, context_overflow=overflow)
    resp = await p.chat(chat_body(user("hello"), max_tokens=1000))
    if overflow == "error":
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["code"] == "context_overflow"
        assert "context window of 200" in err["message"]
        assert p.fake.requests == []
    else:
        assert resp.status == 200
        (record,) = p.calls()
        assert record.sampling["max_tokens"] == 200 - len(record.prompt_token_ids)
    too_long = await p.chat(chat_body(user("x" * 400)))
    assert too_long.status == 400
    assert (await too_long.json())["error"]["param"] == "messages"
