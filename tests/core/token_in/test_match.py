"""`match` says whether a request extends the previous staged call, and if not, why.

Each `NotBridged` reason is shown with the detail a user reads in the record's segment break.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from capture_proxy.core.token_in import BREAK_REASONS, Extension, NotBridged, match
from tests.support.token_in import continued, staged_prior

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "system", "content": "You are a coder."},
    {"role": "user", "content": "list the files"},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"c":"ls"}'}}
ANSWER = {"role": "assistant", "content": "", "reasoning_content": "look", "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}


def prior_call(**keys: Any) -> Any:
    sampled = '<think>\nlook\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {"c":"ls"}}'
    return staged_prior(HISTORY, sampled + "\n</tool_call>", ANSWER, tools=TOOLS, **keys)


def replay(**changes: Any) -> dict[str, Any]:
    return {**ANSWER, **changes}


def test_a_replayed_tool_call_with_its_result_extends_the_call() -> None:
    prior = prior_call()
    request = continued(prior, replay(), RESULT)
    result = match(prior, request)
    assert isinstance(result, Extension)
    assert result.appended == (RESULT,)
    assert result.prior is prior


@pytest.mark.parametrize(
    "replayed",
    [
        # OpenCode re-serializes arguments and drops the call id and the reasoning.
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "bash", "arguments": '{"c": "ls"}'}}
            ],
        },
        # Content as a list of text parts, reasoning kept, a new call id.
        replay(
            content=[{"type": "text", "text": ""}],
            tool_calls=[{**CALL, "id": "other"}],
        ),
    ],
    ids=["reserialized-no-id-no-reasoning", "text-parts-new-id"],
)
def test_a_replay_equal_in_meaning_extends_the_call(replayed: dict[str, Any]) -> None:
    prior = prior_call()
    assert isinstance(match(prior, continued(prior, replayed, RESULT)), Extension)


def test_several_tool_results_and_a_user_message_are_all_appended() -> None:
    prior = prior_call()
    more = [RESULT, {**RESULT, "content": "b.py"}, {"role": "user", "content": "now run it"}]
    result = match(prior, continued(prior, replay(), *more))
    assert isinstance(result, Extension)
    assert list(result.appended) == more


def _break(prior: Any, request: dict[str, Any]) -> NotBridged:
    result = match(prior, request)
    assert isinstance(result, NotBridged), result
    return result


def test_no_prior() -> None:
    assert _break(None, {"messages": HISTORY}) == NotBridged(
        "no_prior", "the rollout has no staged call to continue"
    )


def test_an_edited_message_is_history_edited_naming_it() -> None:
    prior = prior_call()
    request = continued(prior, replay(), RESULT)
    request["messages"][1] = {"role": "user", "content": "list all the files"}
    assert _break(prior, request) == NotBridged("history_edited", "message 1: `content` differs")


def test_a_compacted_history_is_history_edited() -> None:
    prior = prior_call()
    compacted = {**prior.request, "messages": [{"role": "user", "content": "summary"}]}
    assert _break(prior, compacted) == NotBridged(
        "history_edited", "message 0: role 'user' where 'system' was"
    )
    truncated = {**prior.request, "messages": HISTORY[:1]}
    assert _break(prior, truncated) == NotBridged(
        "history_edited", "the request has 1 messages, fewer than the previous call's 2"
    )


def test_a_changed_tool_list_is_tools_changed() -> None:
    prior = prior_call()
    request = {**continued(prior, replay(), RESULT), "tools": TOOLS * 2}
    assert _break(prior, request) == NotBridged(
        "tools_changed", "the tool list differs from the previous call's"
    )


def test_changed_template_kwargs_are_template_changed() -> None:
    prior = prior_call(chat_template_kwargs={"enable_thinking": True})
    request = {**continued(prior, replay(), RESULT), "chat_template_kwargs": {}}
    assert _break(prior, request) == NotBridged(
        "template_changed", "`chat_template_kwargs` differs from the previous call's"
    )


@pytest.mark.parametrize(
    ("replayed", "detail"),
    [
        (replay(content="I ran ls"), "message 2: assistant `content` differs"),
        (replay(reasoning_content="other"), "message 2: assistant `reasoning_content` differs"),
        (replay(tool_calls=[]), "message 2: 0 tool calls where 1 were"),
        (
            replay(tool_calls=[{**CALL, "function": {"name": "bash", "arguments": '{"c":"rm"}'}}]),
            "message 2: tool call 0: arguments differ",
        ),
        (
            replay(tool_calls=[{**CALL, "function": {"name": "sh", "arguments": '{"c":"ls"}'}}]),
            "message 2: tool call 0: name 'sh' where 'bash' was",
        ),
        (RESULT, "message 2: role 'tool' where 'assistant' was"),
    ],
    ids=["content", "reasoning", "tool-count", "arguments", "name", "not-replayed"],
)
def test_a_replay_the_model_did_not_produce_is_reply_mismatch(
    replayed: dict[str, Any], detail: str
) -> None:
    prior = prior_call()
    assert _break(prior, continued(prior, replayed, RESULT)) == NotBridged("reply_mismatch", detail)


@pytest.mark.parametrize(
    "arguments",
    ['{"c": true}', '{"c": 1.0}', '{"c": 999, "c": 1}', '{"c": [1]}', '{"c": "1"}'],
    ids=["true", "float", "key-twice", "list", "string"],
)
def test_replayed_arguments_equal_only_in_python_are_reply_mismatch(arguments: str) -> None:
    # The model wrote {"c": 1}: Python takes True and 1.0 for 1, and a key named twice for its
    # last value; the staged request would keep arguments the model did not write.
    model = {**CALL, "function": {"name": "bash", "arguments": '{"c": 1}'}}
    prior = dataclasses.replace(prior_call(), message={**ANSWER, "tool_calls": [model]})
    forged = replay(tool_calls=[{**CALL, "function": {"name": "bash", "arguments": arguments}}])
    assert _break(prior, continued(prior, forged, RESULT)) == NotBridged(
        "reply_mismatch", "message 2: tool call 0: arguments differ"
    )
    same = replay(tool_calls=[{**CALL, "function": {"name": "bash", "arguments": '{ "c":1 }'}}])
    assert isinstance(match(prior, continued(prior, same, RESULT)), Extension)


@pytest.mark.parametrize("now", ["sha256:other", ""], ids=["other", "unknown"])
def test_a_call_under_another_tokenizer_fingerprint_is_tokenizer_changed(now: str) -> None:
    prior = dataclasses.replace(prior_call(), fingerprint="sha256:staged")
    request = continued(prior, replay(), RESULT)
    cut = match(prior, request, fingerprint=now)
    assert isinstance(cut, NotBridged)
    assert cut.reason == "tokenizer_changed"
    assert "sha256:staged" in cut.detail
    assert isinstance(match(prior, request, fingerprint="sha256:staged"), Extension)


def test_a_request_that_stops_before_the_answer_is_reply_mismatch() -> None:
    prior = prior_call()
    assert _break(prior, dict(prior.request)) == NotBridged(
        "reply_mismatch", "message 2: the previous answer was not replayed"
    )


def test_nothing_after_the_replayed_answer_is_nothing_appended() -> None:
    prior = prior_call()
    assert _break(prior, continued(prior, replay())) == NotBridged(
        "nothing_appended", "no message follows the replayed answer"
    )


def test_an_appended_assistant_message_is_assistant_appended() -> None:
    prior = prior_call()
    request = continued(prior, replay(), RESULT, {"role": "assistant", "content": "done"})
    assert _break(prior, request) == NotBridged(
        "assistant_appended", "message 4 is an assistant message"
    )


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_an_appended_image_extends_the_call() -> None:
    prior = prior_call()
    user = {"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}
    result = match(prior, continued(prior, replay(), RESULT, user))
    assert isinstance(result, Extension)
    assert result.appended == (RESULT, user)


def image_prior() -> Any:
    history = [{"role": "user", "content": [IMAGE]}]
    return staged_prior(history, "nice", {"role": "assistant", "content": "nice"})


NEXT = ({"role": "assistant", "content": "nice"}, {"role": "user", "content": "?"})


def test_an_image_in_the_history_extends_a_call_whose_placeholders_are_known() -> None:
    prior = image_prior()
    assert prior.media is not None
    assert len(prior.media) == 1
    assert isinstance(match(prior, continued(prior, *NEXT)), Extension)


def test_an_image_in_the_history_whose_placeholders_were_not_kept_is_multimodal_history() -> None:
    prior = dataclasses.replace(image_prior(), media=None)
    assert _break(prior, continued(prior, *NEXT)) == NotBridged(
        "multimodal_history",
        "1 images in the earlier messages, and the previous call's image placeholders are "
        "not known",
    )


REF = {"type": "image_url", "image_url": {"url": "attachment:sha256:" + "a" * 64}}


def stored(prior: Any, *, media: Any = dataclasses.MISSING) -> Any:
    """`prior` as read back from the store: its images by reference, as its record has them."""
    request = {**prior.request, "messages": [{"role": "user", "content": [REF]}]}
    kept = prior.media if media is dataclasses.MISSING else media
    return dataclasses.replace(prior, request=request, media=kept, stored=True)


def test_a_call_read_back_is_compared_with_the_request_as_staged() -> None:
    live = image_prior()
    prior = stored(live)
    request = continued(live, *NEXT)  # its image a data: URL, as the client sends it
    staged = continued(prior, *NEXT)  # the same, by reference, as the proxy stages it
    result = match(prior, request, staged)
    assert isinstance(result, Extension)
    assert result.request is request  # rendered with the image itself
    # Without the staged form the reference is not the image the client sent.
    assert _break(prior, request) == NotBridged("history_edited", "message 0: `content` differs")
    # Another image by reference is another image.
    other = {"type": "image_url", "image_url": {"url": "attachment:sha256:" + "b" * 64}}
    edited = {**staged, "messages": [{"role": "user", "content": [other]}, *NEXT]}
    assert match(prior, request, edited) == NotBridged(
        "history_edited", "message 0: `content` differs"
    )


def test_a_call_read_back_without_its_placeholders_is_media_not_recorded() -> None:
    live = image_prior()
    prior = stored(live, media=None)
    result = match(prior, continued(live, *NEXT), continued(prior, *NEXT))
    assert result == NotBridged(
        "media_not_recorded",
        "1 images in the earlier messages, and the previous call's record (read back from the "
        "store) keeps no image placeholders (`token_in_media`): written before records kept "
        "them, more than the proxy keeps, or unreadable",
    )


def test_a_call_read_back_without_images_needs_no_placeholders() -> None:
    prior = dataclasses.replace(prior_call(), stored=True)
    request = continued(prior, replay(), RESULT)
    assert isinstance(match(prior, request, request), Extension)


def test_an_image_in_the_system_message_is_multimodal_history() -> None:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": [IMAGE]},
        {"role": "user", "content": "hi"},
    ]
    prior = staged_prior(history, "nice", {"role": "assistant", "content": "nice"})
    assert _break(prior, continued(prior, *NEXT)) == NotBridged(
        "multimodal_history", "the system message has an image"
    )


def test_an_unknown_break_reason_is_refused() -> None:
    assert "history_edited" in BREAK_REASONS
    with pytest.raises(ValueError, match="unknown break reason 'oops'"):
        NotBridged("oops", "")


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({}, {"add_generation_prompt": True, "continue_final_message": False}),
        ({"chat_template_kwargs": {}}, {"chat_template_kwargs": None}),
        ({}, {"tool_choice": "auto"}),
        ({"add_special_tokens": None}, {"add_special_tokens": False}),
    ],
    ids=["generation-defaults", "empty-kwargs", "tool-choice-auto", "special-tokens"],
)
def test_a_template_key_set_to_its_default_is_the_same_template(
    before: dict[str, Any], after: dict[str, Any]
) -> None:
    prior = prior_call(**before)
    request = {**continued(prior, replay(), RESULT), **after}
    assert isinstance(match(prior, request), Extension)


def test_tool_choice_none_is_a_template_change() -> None:
    prior = prior_call()
    request = {**continued(prior, replay(), RESULT), "tool_choice": "none"}
    assert _break(prior, request) == NotBridged(
        "template_changed", "`tool_choice` differs from the previous call's"
    )
