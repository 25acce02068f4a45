"""The output limit has two spellings (`max_tokens`, `max_completion_tokens`) and vLLM reads
`max_completion_tokens` first: a forced, rollout or default limit must govern whichever spelling
the client used, so the record's sampling states the limit vLLM applied."""

from __future__ import annotations

from typing import Any

import pytest

from capture_proxy.core.policy import RequestPolicy
from tests.support.proxy_harness import chat_body, user


@pytest.mark.parametrize("client_key", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("forced_key", ["max_tokens", "max_completion_tokens"])
def test_a_forced_limit_beats_the_clients_under_either_spelling(
    client_key: str, forced_key: str
) -> None:
    out = RequestPolicy(force={forced_key: 5}).apply({client_key: 40})
    assert out == {forced_key: 5}


def test_a_rollout_limit_beats_the_clients_other_spelling() -> None:
    out = RequestPolicy().apply({"max_completion_tokens": 40}, {"max_tokens": 7})
    assert out == {"max_tokens": 7}


@pytest.mark.parametrize("client_key", ["max_tokens", "max_completion_tokens"])
def test_a_default_limit_is_not_added_beside_the_clients(client_key: str) -> None:
    out = RequestPolicy(defaults={"max_tokens": 100}).apply({client_key: 40})
    assert out == {client_key: 40}


def test_a_default_limit_fills_a_request_without_one() -> None:
    assert RequestPolicy(defaults={"max_completion_tokens": 100}).apply({}) == {
        "max_completion_tokens": 100
    }


async def test_vllm_generates_under_the_forced_limit_and_the_record_says_so(
    make_proxy: Any,
) -> None:
    p = await make_proxy(policy_force={"max_tokens": 5})
    resp = await p.chat(chat_body(user("write a long story"), max_completion_tokens=40))
    assert resp.headers["X-Capture-Status"] == "staged"
    sent = p.fake.requests[0]
    assert sent["max_tokens"] == 5
    assert "max_completion_tokens" not in sent
    (record,) = p.calls()
    assert len(record.completion_token_ids) <= 5
    assert record.sampling["max_tokens"] == 5
    assert "max_completion_tokens" not in record.sampling
