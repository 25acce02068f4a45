"""The bridged prompt: the model's own tokens, then exactly the template's tokens after them.

Renders come from the fake vLLM's Qwen3-style template (`tests/support/token_in.py`), which
drops the reasoning of assistant turns before the last user message: re-rendering the history
is not what the model saw, and the bridge must not depend on it.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture_proxy.core.token_in import (
    END_OF_TURN_ADDED,
    TURN_CLOSE,
    Bridged,
    BridgeRenders,
    Extension,
    MediaItem,
    NotBridged,
    Prior,
    assemble,
    bridged_features,
    common_suffix,
    divergence,
    match,
    plan,
)
from capture_proxy.testing.fake_vllm._template import (
    IM_END,
    SPECIAL_TOKENS,
    encode,
    tool_call_text,
)
from tests.support.token_in import continued, features_of, render_ids, render_plan, staged_prior

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm-0.32.0" / "token-in"
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "system", "content": "You are a coder."},
    {"role": "user", "content": "list the files"},
]
NL = encode("\n")
GENERATION = encode("<|im_start|>assistant\n")


def bridge(prior: Prior, request: dict[str, Any]) -> Bridged:
    ext = match(prior, request)
    assert isinstance(ext, Extension), ext
    result = assemble(prior, plan(request, ext), render_plan(plan(request, ext)))
    assert isinstance(result, Bridged), result
    return result


def chat_prior(finish_reason: str = "stop") -> Prior:
    answer = {"role": "assistant", "content": "Which files?", "reasoning_content": "hm"}
    sampled = "<think>\nhm\n</think>\n\nWhich files?"
    return staged_prior(HISTORY, sampled, answer, finish_reason=finish_reason)


USER = {"role": "user", "content": "all of them"}
USER_TOKENS = encode("<|im_start|>user\nall of them<|im_end|>\n")


def test_a_completion_ending_on_its_end_of_turn_token_gets_the_text_after_it() -> None:
    prior = chat_prior("stop")
    assert prior.completion_ids[-1] == IM_END
    bridged = bridge(prior, continued(prior, prior.message, USER))
    base = len(prior.prompt_ids) + len(prior.completion_ids)
    assert bridged.prompt_ids == [
        *prior.prompt_ids,
        *prior.completion_ids,
        *NL,
        *USER_TOKENS,
        *GENERATION,
    ]
    assert bridged.bridge_spans == ((base, base + 1, TURN_CLOSE),)
    assert bridged.appended_start == base + 1


def test_a_completion_cut_by_length_gets_the_whole_turn_close_recorded_as_added() -> None:
    prior = chat_prior("length")
    assert prior.completion_ids[-1] != IM_END
    bridged = bridge(prior, continued(prior, prior.message, USER))
    base = len(prior.prompt_ids) + len(prior.completion_ids)
    assert bridged.prompt_ids[base:] == [IM_END, *NL, *USER_TOKENS, *GENERATION]
    assert bridged.bridge_spans == ((base, base + 2, END_OF_TURN_ADDED),)


#: A Llama-2-style close: a plain token (a space) before the stop token, ids of our own.
SPACE, EOS, ENDOFTEXT = 9, 0, SPECIAL_TOKENS["<|endoftext|>"]
APPENDED = [50, 51, 52]


def renders_with_close(close: list[int]) -> BridgeRenders:
    """Renders of a template whose turn close is `close` and whose appended messages render as
    `APPENDED` (the two renders of each pair differ only in the dummy content, 7 or 8)."""
    return BridgeRenders(
        close=([1, 7, *close], [1, 8, *close]),
        suffix=([1, 7, *close, *APPENDED], [1, 8, *close, *APPENDED]),
    )


def assembled(completion: list[int], close: list[int], **prior_keys: Any) -> Bridged | NotBridged:
    base = chat_prior()
    prior = Prior(base.request, base.message, base.prompt_ids, completion, "stop", **prior_keys)
    request = continued(prior, prior.message, USER)
    ext = match(prior, request)
    assert isinstance(ext, Extension), ext
    return assemble(prior, plan(request, ext), renders_with_close(close))


def test_a_stop_token_after_a_plain_token_in_the_close_gets_only_what_follows_it() -> None:
    # Llama-2 closes a turn with " </s>"; the model sampled </s> without the space. The prompt
    # continues after the sampled </s>: no second </s>, no space the model never saw.
    bridged = assembled([20, 21, EOS], [SPACE, EOS])
    assert isinstance(bridged, Bridged), bridged
    exact = [*chat_prior().prompt_ids, 20, 21, EOS]
    assert bridged.prompt_ids == [*exact, *APPENDED]
    assert bridged.bridge_spans == ()
    # Sampled with its space, the same.
    bridged = assembled([20, SPACE, EOS], [SPACE, EOS])
    assert isinstance(bridged, Bridged), bridged
    assert bridged.prompt_ids[-len(APPENDED) - 2 :] == [SPACE, EOS, *APPENDED]
    # A close with tokens after the stop token: those, as the turn close.
    bridged = assembled([20, EOS], [SPACE, EOS, 26])
    assert isinstance(bridged, Bridged), bridged
    base = len(chat_prior().prompt_ids) + 2
    assert bridged.prompt_ids[base:] == [26, *APPENDED]
    assert bridged.bridge_spans == ((base, base + 1, TURN_CLOSE),)


def test_a_completion_that_stopped_on_another_stop_token_is_not_bridged() -> None:
    # ChatML closes with <|im_end|>\n; the model ended on <|endoftext|>, which the close does not
    # hold: what the template would write after it is unknown.
    got = assembled([20, 21, ENDOFTEXT], [IM_END, *NL])
    assert isinstance(got, NotBridged)
    assert got.reason == "stopped_on_other_token"
    assert str(ENDOFTEXT) in got.detail
    # A stop string (vLLM's stop_reason is the string) is no stop token: the whole close.
    bridged = assembled([20, 21, 22], [IM_END, *NL], stop_reason="21 22")
    assert isinstance(bridged, Bridged), bridged
    assert bridged.bridge_spans[0][2] == END_OF_TURN_ADDED


def test_a_stop_string_left_out_of_the_output_gets_the_whole_turn_close() -> None:
    # vLLM excludes a matched stop string: the completion stops with "stop" but without <|im_end|>.
    prior = chat_prior("length")
    stopped = Prior(
        prior.request,
        prior.message,
        prior.prompt_ids,
        prior.completion_ids,
        "stop",
        stop_reason="</answer>",
    )
    bridged = bridge(stopped, continued(stopped, stopped.message, USER))
    base = len(prior.prompt_ids) + len(prior.completion_ids)
    assert bridged.bridge_spans == ((base, base + 2, END_OF_TURN_ADDED),)


def test_a_new_user_message_keeps_the_reasoning_the_plain_rendering_drops() -> None:
    prior = chat_prior()
    request = continued(prior, prior.message, USER)
    bridged = bridge(prior, request)
    plain = render_ids(request)
    # The plain rendering drops "<think>\nhm\n</think>\n\n" of the answer: it differs exactly
    # where the model's completion starts, and the bridged prompt keeps the model's tokens.
    assert divergence(bridged.prompt_ids, plain) == len(prior.prompt_ids)
    start = len(prior.prompt_ids)
    assert bridged.prompt_ids[start : start + len(prior.completion_ids)] == prior.completion_ids
    assert bridged.prompt_ids[: len(prior.prompt_ids)] == prior.prompt_ids
    # Past the dropped reasoning, both end with the same tokens for the new turn.
    assert bridged.prompt_ids[-len(USER_TOKENS) - len(GENERATION) :] == USER_TOKENS + GENERATION
    assert plain[-len(USER_TOKENS) - len(GENERATION) :] == USER_TOKENS + GENERATION


def tool_prior(arguments: str = '{"c":"ls"}') -> Prior:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    answer = {"role": "assistant", "content": "", "tool_calls": [call]}
    return staged_prior(HISTORY, tool_call_text("bash", arguments), answer, tools=TOOLS)


def result(text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": "c1", "content": text}


def test_tool_arguments_the_client_reserialized_stay_as_the_model_wrote_them() -> None:
    prior = tool_prior('{"c":"ls"}')
    replayed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": '{"c": "ls"}'}}
        ],
    }
    request = continued(prior, replayed, result("a.py"))
    bridged = bridge(prior, request)
    plain = render_ids(request)
    where = divergence(bridged.prompt_ids, plain)
    assert where is not None
    assert bridged.prompt_ids[where] == encode('"')[0]  # {"c":"ls"} as sampled ...
    assert plain[where] == encode(" ")[0]  # ... {"c": "ls"} re-rendered
    base = len(prior.prompt_ids) + len(prior.completion_ids)
    assert bridged.prompt_ids[:base] == [*prior.prompt_ids, *prior.completion_ids]


def test_several_tool_results_render_as_one_user_turn_after_the_close() -> None:
    prior = tool_prior()
    request = continued(prior, prior.message, result("a.py"), result("b.py"))
    bridged = bridge(prior, request)
    expected = encode(
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n"
        "<tool_response>\nb.py\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert bridged.prompt_ids[bridged.appended_start :] == expected
    # The template is append-only for tool results and the arguments were replayed verbatim:
    # the bridged prompt is the plain one.
    assert divergence(bridged.prompt_ids, render_ids(request)) is None


def test_divergence_positions() -> None:
    assert divergence([1, 2, 3], [1, 2, 3]) is None
    assert divergence([1, 2, 3], [1, 9, 3]) == 1
    assert divergence([1, 2], [1, 2, 3]) == 2
    assert divergence([], []) is None


def _long_prompts(n: int, m: int, at: int) -> tuple[list[int], list[int], int]:
    """Prompts of `n` and `m` ids, the second changed at `at` (when it has it), and where
    they first differ (the shorter one's length when nowhere)."""
    a = list(range(n))
    b = list(range(m))
    if at < m:
        b[at] = -1
    return a, b, next((i for i in range(min(n, m)) if a[i] != b[i]), min(n, m))


@given(st.integers(0, 2000), st.integers(0, 2000), st.integers(0, 2000))
def test_divergence_over_long_prompts_is_the_first_differing_position(
    n: int, m: int, at: int
) -> None:
    a, b, shared = _long_prompts(n, m, at)
    expected = None if a == b else shared
    assert divergence(a, b) == expected
    assert divergence(array("i", a), b) == expected
    assert divergence(array("i", a), array("i", b)) == expected


@given(st.integers(0, 2000), st.integers(0, 2000), st.integers(0, 2000), st.integers(0, 100))
def test_divergence_after_ids_known_to_be_the_same_is_the_whole_comparison_s(
    n: int, m: int, at: int, percent: int
) -> None:
    a, b, shared = _long_prompts(n, m, at)
    # Any count of ids up to the first difference, known to be the same, is not compared again.
    same = shared * percent // 100
    assert divergence(a, b, same=same) == divergence(a, b)
    assert divergence(array("i", a), array("i", b), same=same) == divergence(a, b)


def test_common_suffix() -> None:
    assert common_suffix([1, 5, 2, 3], [1, 6, 2, 3]) == [2, 3]
    assert common_suffix([1], [2]) == []
    assert common_suffix([], [1]) == []


def _planned() -> tuple[Prior, Any]:
    prior = chat_prior()
    request = continued(prior, prior.message, USER)
    ext = match(prior, request)
    assert isinstance(ext, Extension)
    return prior, plan(request, ext)


def test_renders_without_a_common_close_are_not_bridgeable() -> None:
    prior, p = _planned()
    # A template that writes nothing after an assistant's content: the two renders end on v.
    rendered = BridgeRenders(close=([1, 65], [1, 66]), suffix=([1, 65, 7], [1, 66, 7]))
    assert assemble(prior, p, rendered) == NotBridged(
        "template_not_bridgeable",
        "the two dummy renders share no closing tokens: the template writes nothing after an "
        "assistant turn's content",
    )


def test_an_appended_rendering_not_starting_with_the_close_is_not_bridgeable() -> None:
    prior, p = _planned()
    good = render_plan(p)
    # A template that closes the last assistant turn differently when more messages follow.
    assert isinstance(good.suffix, tuple)  # a pair, as `render_plan` gives it
    changed = tuple(
        [*ids[: -len(USER_TOKENS) - len(GENERATION) - 2], 99, *USER_TOKENS] for ids in good.suffix
    )
    rendered = BridgeRenders(close=good.close, suffix=(changed[0], changed[1]))
    assert assemble(prior, p, rendered) == NotBridged(
        "template_not_bridgeable",
        "the rendering of the appended messages does not start with the turn's end (2 tokens)",
    )


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
PAD = SPECIAL_TOKENS["<|image_pad|>"]


def with_image(text: str, url: str = "data:image/png;base64,AAAA") -> dict[str, Any]:
    image = {"type": "image_url", "image_url": {"url": url}}
    return {"role": "user", "content": [{"type": "text", "text": text}, image]}


def test_an_appended_image_is_placed_where_its_render_puts_it() -> None:
    prior = chat_prior()
    request = continued(prior, prior.message, with_image("this one"))
    bridged = bridge(prior, request)
    [item] = bridged.media
    assert bridged.prompt_ids[item.offset : item.offset + item.length] == [PAD]
    assert item.offset > bridged.appended_start
    # Where the request's own render has the same image (another position: it drops the
    # reasoning), with its data: generate's features place it in the bridged prompt.
    plain = render_ids(request)
    rendered = features_of(request, plain)
    features, why = bridged_features(bridged.media, rendered)
    assert why is None
    assert features == {
        **rendered,
        "mm_placeholders": {"image": [{"offset": item.offset, "length": 1}]},
    }
    assert rendered["mm_placeholders"]["image"][0]["offset"] != item.offset


def test_the_previous_calls_images_stay_where_they_were() -> None:
    history = [*HISTORY[:1], with_image("first", "data:image/png;base64,AAAA")]
    prior = staged_prior(history, "ok", {"role": "assistant", "content": "ok"})
    assert prior.media is not None
    request = continued(prior, prior.message, with_image("second", "data:image/png;base64,BBBB"))
    bridged = bridge(prior, request)
    first, second = bridged.media
    assert first == prior.media[0]
    assert bridged.prompt_ids[first.offset] == bridged.prompt_ids[second.offset] == PAD
    assert first.hash != second.hash
    rendered = features_of(request, render_ids(request))
    assert bridged_features(bridged.media, rendered)[1] is None


def test_renders_that_place_another_number_of_images_are_multimodal_append() -> None:
    prior = chat_prior()
    request = continued(prior, prior.message, with_image("this one"))
    ext = match(prior, request)
    assert isinstance(ext, Extension)
    p = plan(request, ext)
    good = render_plan(p)
    assert assemble(prior, p, BridgeRenders(good.close, good.suffix)) == NotBridged(
        "multimodal_append", "the appended messages have 1 images, their renders place 0"
    )
    assert isinstance(good.suffix, tuple)  # a pair, as `render_plan` gives it
    early = MediaItem("image", "h", -len(good.suffix[0]), 1)
    assert assemble(prior, p, BridgeRenders(good.close, good.suffix, media=(early,))) == (
        NotBridged(
            "multimodal_append", "an image's placeholder is not in the appended messages' tokens"
        )
    )


def test_render_answers_are_read_from_vllms_generate_request() -> None:
    answer = json.loads((FIXTURES / "render-chat-response.json").read_text())
    n = len(answer["token_ids"])
    features = {
        "mm_hashes": {"image": ["h1"]},
        "mm_placeholders": {"image": [{"offset": n - 3, "length": 2}]},
        "kwargs_data": {"image": ["AAAA"]},
        "mm_metadata": None,
    }
    imaged = {**answer, "features": features}
    rendered = BridgeRenders.from_answers((answer, answer), (imaged, imaged))
    assert rendered.close == (answer["token_ids"], answer["token_ids"])
    assert rendered.media == (MediaItem("image", "h1", -3, 2),)
    with pytest.raises(ValueError, match=r"render answer suffix\[1\]: token_ids must be a list"):
        BridgeRenders.from_answers((answer, answer), (answer, {**answer, "token_ids": None}))
    with pytest.raises(ValueError, match="the two suffix renders place their images differently"):
        BridgeRenders.from_answers((answer, answer), (answer, imaged))
    with pytest.raises(ValueError, match="`features` has no mm_hashes or mm_placeholders"):
        BridgeRenders.from_answers((answer, answer), (answer, {**answer, "features": {"x": 1}}))


def _tool_plan() -> tuple[Prior, Any, dict[str, Any]]:
    prior = tool_prior()
    request = continued(prior, prior.message, result("a.py"))
    ext = match(prior, request)
    assert isinstance(ext, Extension)
    return prior, plan(request, ext), request


def test_an_answer_with_tool_calls_renders_the_dummy_with_them() -> None:
    _, p, request = _tool_plan()
    assert p.turn is not None
    for body in (*p.turn, *p.suffix):
        assert body["messages"][2]["tool_calls"] == request["messages"][2]["tool_calls"]
    assert [b["add_generation_prompt"] for b in p.turn] == [False, False]
    assert p.requests() == [*p.close, *p.turn, *p.suffix]
    assert "tool_calls" not in p.close[0]["messages"][2]
    _, chat = _planned()
    assert chat.turn is None
    assert chat.requests() == [*chat.close, *chat.suffix]


def strict_render(body: dict[str, Any]) -> list[int]:
    """A template that, like gpt-oss's, refuses a tool result after a turn without tool calls."""
    messages = body["messages"]
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            before = next(m for m in reversed(messages[:i]) if m["role"] != "tool")
            if not before.get("tool_calls"):
                raise ValueError("Message has tool role, but there was no previous tool call")
    return render_ids(body)


def test_a_template_that_needs_the_tool_call_before_a_result_is_bridged() -> None:
    prior, p, request = _tool_plan()
    assert p.turn is not None
    rendered = BridgeRenders(
        close=(strict_render(p.close[0]), strict_render(p.close[1])),
        suffix=(strict_render(p.suffix[0]), strict_render(p.suffix[1])),
        turn=(strict_render(p.turn[0]), strict_render(p.turn[1])),
    )
    bridged = assemble(prior, p, rendered)
    assert isinstance(bridged, Bridged)
    assert bridged.prompt_ids == render_ids(request)


def test_a_tool_call_turn_closed_by_other_tokens_is_not_bridgeable() -> None:
    prior, p, _ = _tool_plan()
    assert p.turn is not None

    def call_close(body: dict[str, Any]) -> list[int]:
        # Like gpt-oss's <|call|>: a turn that calls a tool ends with its own token.
        ids = render_ids(body)
        end_of_call = encode("</tool_call><|im_end|>")
        for i in range(len(ids) - len(end_of_call) + 1):
            if ids[i : i + len(end_of_call)] == end_of_call:
                ids[i + len(end_of_call) - 1] = 0
        return ids

    rendered = BridgeRenders(
        close=(call_close(p.close[0]), call_close(p.close[1])),
        suffix=(call_close(p.suffix[0]), call_close(p.suffix[1])),
        turn=(call_close(p.turn[0]), call_close(p.turn[1])),
    )
    assert assemble(prior, p, rendered) == NotBridged(
        "template_not_bridgeable",
        "a turn with tool calls does not end with the turn close of one without",
    )


def test_a_plan_with_tool_calls_needs_its_turn_renders() -> None:
    prior, p, _ = _tool_plan()
    full = render_plan(p)
    with pytest.raises(ValueError, match=r"pass them in BridgeRenders\.turn"):
        assemble(prior, p, BridgeRenders(full.close, full.suffix))


def test_renders_that_ignore_the_assistant_content_are_not_bridgeable() -> None:
    prior, p = _planned()
    good = render_plan(p)
    same = BridgeRenders(close=(good.close[0], good.close[0]), suffix=good.suffix)
    assert assemble(prior, p, same) == NotBridged(
        "template_not_bridgeable",
        "the two close renders are the same: the template does not render the assistant's content",
    )
