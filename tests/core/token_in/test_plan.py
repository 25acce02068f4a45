"""`plan` asks for renders of a dummy conversation, never of the real history."""

from __future__ import annotations

from typing import Any

from capture_proxy.core.token_in import DUMMY_CONTENTS, Extension, match, plan
from tests.support.token_in import continued, staged_prior

SYSTEM = {"role": "system", "content": "You are a coder."}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
KWARGS = {"enable_thinking": False}


def extension(history: list[dict[str, Any]], *appended: dict[str, Any], **keys: Any) -> Extension:
    answer = {"role": "assistant", "content": "ok"}
    prior = staged_prior(history, "ok", answer, tools=TOOLS, **keys)
    result = match(prior, continued(prior, answer, *appended))
    assert isinstance(result, Extension), result
    return result


def test_the_renders_are_the_dummy_conversation_with_the_requests_template_keys() -> None:
    user = {"role": "user", "content": "next"}
    ext = extension([SYSTEM, {"role": "user", "content": "hi"}], user, chat_template_kwargs=KWARGS)
    p = plan(ext.request, ext)
    v1, v2 = DUMMY_CONTENTS
    for body, v in zip(p.close, (v1, v2), strict=True):
        assert body["messages"] == [
            SYSTEM,
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": v},
        ]
        assert body["add_generation_prompt"] is False
    for body, v in zip(p.suffix, (v1, v2), strict=True):
        assert body["messages"][2:] == [{"role": "assistant", "content": v}, user]
        assert "add_generation_prompt" not in body  # vLLM's default: true
    for body in (*p.close, *p.suffix):
        assert body["tools"] == TOOLS
        assert body["chat_template_kwargs"] == KWARGS
        assert body["model"] == "policy"
        assert "continue_final_message" not in body  # vLLM's default: false
    # A request that continues its final message still gets dummies that do not.
    cont = extension([SYSTEM, {"role": "user", "content": "hi"}], user, continue_final_message=True)
    assert all("continue_final_message" not in b for b in plan(cont.request, cont).suffix)


def test_the_close_key_depends_on_system_tools_and_template_not_on_history() -> None:
    first = extension([SYSTEM, {"role": "user", "content": "a"}], {"role": "user", "content": "b"})
    later = extension(
        [SYSTEM, {"role": "user", "content": "other"}],
        {"role": "tool", "tool_call_id": "x", "content": "r"},
    )
    assert plan(first.request, first).close_key == plan(later.request, later).close_key
    other_system = extension(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"}],
        {"role": "user", "content": "b"},
    )
    assert (
        plan(other_system.request, other_system).close_key != plan(first.request, first).close_key
    )
    kwargs = extension(
        [SYSTEM, {"role": "user", "content": "a"}],
        {"role": "user", "content": "b"},
        chat_template_kwargs=KWARGS,
    )
    assert plan(kwargs.request, kwargs).close_key != plan(first.request, first).close_key


def test_without_a_system_message_the_dummy_starts_with_the_user() -> None:
    ext = extension([{"role": "user", "content": "hi"}], {"role": "user", "content": "next"})
    p = plan(ext.request, ext)
    assert p.close[0]["messages"][0] == {"role": "user", "content": "u"}


def test_a_request_without_generation_prompt_keeps_it_off_in_the_suffix() -> None:
    ext = extension([{"role": "user", "content": "hi"}], {"role": "user", "content": "next"})
    request = {**ext.request, "add_generation_prompt": False}
    p = plan(request, ext)
    assert [b["add_generation_prompt"] for b in p.suffix] == [False, False]
