"""A steady call without dummy renders (`core/token_in/_steady.py`): once a shape of appended
messages was learnt, a bridged call reads its appended tokens from the request's own rendering,
and falls back to the dummy renders whenever the rendering does not place them beyond doubt."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from capture_proxy.adapters.vllm import read_render
from capture_proxy.core.token_in import (
    CloseRenders,
    Prior,
    RenderRefused,
    TokenInPrompt,
    token_in_prompt,
)
from capture_proxy.core.token_in._steady import eos_in_close, from_rendering, learnt_count
from capture_proxy.core.token_in._values import Bridged
from capture_proxy.testing.fake_vllm import FakeVLLM
from capture_proxy.testing.fake_vllm._template import IM_END, encode
from capture_proxy.upstream.http import HTTPUpstream
from tests.support.token_in import continued, render_ids, served, staged_prior, tool_turns

RENDER = "/v1/chat/completions/render"
SYSTEM = {"role": "system", "content": "Be terse."}
ANSWER = {"role": "assistant", "content": "Yes."}


class _Counting(FakeVLLM):
    """The fake with a log of the render requests it got."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(scale_out=True, drop_past_reasoning=True, **kwargs)

    @property
    def renders(self) -> int:
        return self.route_hits[RENDER]


class _SkipsClose(_Counting):
    """A template that writes no turn close after an assistant answer "Skip." (a close that
    depends on the content: the dummy renders' answers, "A" and "B", have theirs)."""

    def _render(self, messages: Any, tools: Any, gen: bool) -> str:
        text = super()._render(messages, tools, gen)
        return text.replace("Skip.<|im_end|>\n", "Skip.")


@contextlib.asynccontextmanager
async def _learnt(
    fake: FakeVLLM,
) -> AsyncIterator[tuple[HTTPUpstream, CloseRenders, Prior, dict[str, Any]]]:
    """A client of `fake` and a cache that learnt the template's close from a first bridged
    call (a user message after the answer "Yes."): the client, the cache, that call's prior and
    request."""
    async with served(fake) as client:
        closes = CloseRenders()
        prior = _prior(SYSTEM, {"role": "user", "content": "One?"})
        first = continued(prior, ANSWER, {"role": "user", "content": "Two?"})
        await token_in_prompt(client, closes, prior, first, first)
        yield client, closes, prior, first


def _prior(*messages: dict[str, Any], said: str = "Yes.", finish: str = "stop") -> Prior:
    request = {"model": "policy", "messages": list(messages)}
    completion = [*encode(said), *([IM_END] if finish == "stop" else [])]
    return Prior(
        request, {"role": "assistant", "content": said}, render_ids(request), completion, finish
    )


async def _as_the_dummies_give(
    client: HTTPUpstream, got: TokenInPrompt, prior: Prior, request: dict[str, Any]
) -> TokenInPrompt:
    """The same call bridged by a cache that always makes the dummy renders; `got` is checked
    to be its prompt, spans and divergence."""
    paired = await token_in_prompt(client, CloseRenders(steady=False), prior, request, request)
    assert (got.segment_break, paired.segment_break) == (None, None)
    assert (got.prompt_ids, got.bridge_spans) == (paired.prompt_ids, paired.bridge_spans)
    assert got.plain_divergence == paired.plain_divergence
    return paired


async def test_after_the_first_bridged_call_a_call_renders_only_the_request() -> None:
    fake = _Counting()
    async with served(fake) as client:
        closes = CloseRenders()
        for k, (prior, request) in enumerate(tool_turns(4)):
            before = fake.renders
            got = await token_in_prompt(client, closes, prior, request, request)
            # The first call: the request, the close, tool-call turn and suffix pairs; later
            # ones the request alone. The prompt is the one the dummy renders give.
            assert fake.renders - before == (7 if k == 0 else 1)
            await _as_the_dummies_give(client, got, prior, request)
            assert got.ids_json == orjson.dumps(got.prompt_ids)


def _reasoned(*messages: dict[str, Any]) -> tuple[Prior, dict[str, Any]]:
    """A staged answer with reasoning and the replayed message: a user message after it makes
    the fake's template drop the reasoning (as Qwen3's does), so the request's own rendering
    does not spell the answer as it was sampled."""
    answer = {"role": "assistant", "content": "Yes.", "reasoning_content": "hm"}
    prior = staged_prior(list(messages), "<think>\nhm\n</think>\n\nYes.", answer)
    return prior, answer


async def test_an_answer_rendered_otherwise_is_placed_by_its_end_of_turn_token() -> None:
    fake = _Counting()
    async with served(fake) as client:
        closes = CloseRenders()
        prior, answer = _reasoned(SYSTEM, {"role": "user", "content": "One?"})
        for k, text in enumerate(("Two?", "Three?", "Four, then five?")):
            request = continued(prior, answer, {"role": "user", "content": text})
            before = fake.renders
            got = await token_in_prompt(client, closes, prior, request, request)
            # The first call learns the shape from the dummy renders; then the request alone.
            assert fake.renders - before == (5 if k == 0 else 1)
            await _as_the_dummies_give(client, got, prior, request)
            # The plain rendering dropped the reasoning: it diverges inside the answer.
            assert got.plain_divergence == len(prior.prompt_ids)


async def test_an_appended_message_that_spells_the_end_of_turn_token_makes_the_dummy_renders() -> (
    None
):
    fake = _Counting()
    async with served(fake) as client:
        closes = CloseRenders()
        prior, answer = _reasoned(SYSTEM, {"role": "user", "content": "One?"})
        first = continued(prior, answer, {"role": "user", "content": "Two?"})
        await token_in_prompt(client, closes, prior, first, first)  # learns the shape
        # The user's text holds "<|im_end|>", which the tokenizer turns into the end-of-turn
        # token: the rendering has one more after the answer than the shape showed.
        spelled = continued(prior, answer, {"role": "user", "content": "a<|im_end|>b"})
        before = fake.renders
        got = await token_in_prompt(client, closes, prior, spelled, spelled)
        assert fake.renders - before == 2  # the request, then the suffix's anchored render
        await _as_the_dummies_give(client, got, prior, spelled)
        after = len(prior.prompt_ids) + len(prior.completion_ids)
        assert got.prompt_ids[after:].count(IM_END) == 2  # the user's, and its turn's close


async def test_an_answer_rendered_as_sampled_is_read_after_whatever_the_messages_spell() -> None:
    fake = _Counting()
    async with _learnt(fake) as (client, closes, prior, _):
        # The rendering spells the previous prompt and answer as sent: the appended tokens
        # are what follows them and the close, the user's "<|im_end|>" included.
        spelled = continued(prior, ANSWER, {"role": "user", "content": "a<|im_end|>b"})
        before = fake.renders
        got = await token_in_prompt(client, closes, prior, spelled, spelled)
        assert fake.renders - before == 1
        await _as_the_dummies_give(client, got, prior, spelled)
        assert got.plain_divergence is None


async def test_a_close_the_template_leaves_out_is_not_read_past() -> None:
    fake = _SkipsClose()
    async with _learnt(fake) as (client, closes, _, first):
        # Answered "Skip.": the request's own rendering has no close after it, so the end of
        # turn token the count from the front finds is the appended message's. The count
        # behind it is not the shape's: the dummy renders decide, and they do not bridge.
        skipped = _prior(SYSTEM, {"role": "user", "content": "One?"}, said="Skip.")
        request = continued(
            skipped, {"role": "assistant", "content": "Skip."}, first["messages"][-1]
        )
        before = fake.renders
        got = await token_in_prompt(client, closes, skipped, request, request)
        assert fake.renders - before > 1  # the request's, then the dummy renders
        assert got.segment_break is not None
        assert got.segment_break.reason == "template_not_bridgeable"
        assert got.prompt_ids == encode(fake._render(request["messages"], None, True))


class _EndsOtherwise(_Counting):
    """A template that ends the real conversation's rendering with one more newline than the
    dummy conversations' (its end depends on the conversation)."""

    def _render_ids(self, body: Any) -> list[int]:
        ids = super()._render_ids(body)
        dummy = any(m.get("content") in ("A", "B") for m in body["messages"])
        return ids if dummy else [*ids, *encode("\n")]


async def test_a_steady_call_takes_the_template_s_own_tokens_where_the_dummies_refuse() -> None:
    fake = _EndsOtherwise()
    async with served(fake) as client:
        closes = CloseRenders()
        prior = _prior(SYSTEM, {"role": "user", "content": "One?"})
        first = continued(prior, ANSWER, {"role": "user", "content": "Two?"})
        learning = await token_in_prompt(client, closes, prior, first, first)
        # The dummies say the appended tokens end without the newline the request's own
        # rendering ends with: they do not bridge (the template writes otherwise here).
        assert learning.segment_break is not None
        assert learning.segment_break.reason == "template_not_bridgeable"
        # Read from the rendering, the place is the same and the tokens are the template's own
        # for this conversation: bridged, the newline included.
        before = fake.renders
        got = await token_in_prompt(client, closes, prior, first, first)
        assert fake.renders - before == 1
        assert got.segment_break is None
        sent = [*prior.prompt_ids, *prior.completion_ids]
        assert got.prompt_ids[: len(sent)] == sent
        assert got.prompt_ids == fake._render_ids(first)
        assert got.placed == "rendering"


async def test_a_completion_cut_by_length_gets_the_whole_close_without_dummy_renders() -> None:
    fake = _Counting()
    async with _learnt(fake) as (client, closes, _, first):
        cut = _prior(SYSTEM, {"role": "user", "content": "One?"}, finish="length")
        before = fake.renders
        got = await token_in_prompt(client, closes, cut, first, first)
        # No end-of-turn token sampled: the whole close is added, where the rendering has it.
        assert fake.renders - before == 1
        await _as_the_dummies_give(client, got, cut, first)
        assert got.bridge_spans[0][2] == "end_of_turn_added"


class _RefusesTheRequest(_Counting):
    """Answers the request's own render (not a dummy's) with vLLM's 400 when `refuse` is set."""

    refuse = False

    async def _render_chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        dummy = any(m.get("content") in ("A", "B") for m in body["messages"])
        if self.refuse and not dummy:
            self.route_hits[request.path] += 1
            error = {"message": "too long", "type": "BadRequestError", "code": 400}
            return web.json_response({"error": error}, status=400)
        return await super()._render_chat(request)


async def test_a_steady_call_whose_render_is_refused_gets_vllm_s_answer_and_no_dummies() -> None:
    fake = _RefusesTheRequest()
    async with _learnt(fake) as (client, closes, prior, first):
        fake.refuse = True
        before = fake.renders
        with pytest.raises(RenderRefused) as refused:
            await token_in_prompt(client, closes, prior, first, first)
        # vLLM's own answer, relayed to the client as the chat route's would be; no dummy
        # render was sent for a call that has no prompt.
        assert refused.value.status == 400
        assert b"too long" in refused.value.body
        assert fake.renders - before == 1
        # Nothing learnt was lost: the next call is steady again.
        fake.refuse = False
        before = fake.renders
        again = await token_in_prompt(client, closes, prior, first, first)
        assert fake.renders - before == 1
        assert again.segment_break is None
        assert again.placed == "rendering"


def _rendered(ids: list[int]) -> Any:
    return read_render(orjson.dumps({"token_ids": ids}))


def test_a_llama2_close_is_found_by_its_end_of_turn_token() -> None:
    # Llama-2 closes with " </s>" (here 48, then 2); the model sampled </s> without the space.
    # The request's rendering writes the answer "  </s>" with two spaces in one token (300).
    close, appended = (48, 2), [1, 50, 51]
    prior = Prior({}, {}, [1, 60, 61, 48, 2, 1, 62], [70, 2], "stop")
    at = eos_in_close(prior, close)
    assert at == 1
    plain = _rendered([1, 60, 61, 48, 2, 1, 62, 300, 2, *appended])
    got = from_rendering(prior, close, at, 0, plain)
    assert got is not None
    assert got.prompt_ids == [1, 60, 61, 48, 2, 1, 62, 70, 2, *appended]
    assert (got.bridge_spans, got.appended_start) == ((), 9)
    # The rendering lost the answer's </s>: the count from the front lands on none.
    assert (
        from_rendering(prior, close, at, 0, _rendered([1, 60, 61, 48, 2, 1, 62, 300, *appended]))
        is None
    )
    # A history message whose text spells </s> gained one: the count behind is not the shape's.
    gained = _rendered([1, 60, 2, 61, 48, 2, 1, 62, 300, 2, *appended])
    assert from_rendering(prior, close, at, 0, gained) is None


def test_a_chatml_close_s_newline_is_the_bridge_span() -> None:
    close = (2, 26)  # <|im_end|> "\n"
    prior = Prior({}, {}, [1, 60, 2, 26, 1, 61], [70, 2], "stop")
    plain = _rendered([1, 60, 2, 26, 1, 61, 70, 2, 26, 1, 62, 2, 26, 1, 63])
    got = from_rendering(prior, close, 0, 1, plain)
    assert got is not None
    assert got.prompt_ids == [1, 60, 2, 26, 1, 61, 70, 2, 26, 1, 62, 2, 26, 1, 63]
    assert got.bridge_spans == ((8, 9, "turn_close"),)
    # The close's "\n" not after the answer's <|im_end|>: not read.
    moved = _rendered([1, 60, 2, 26, 1, 61, 70, 2, 27, 1, 62, 2, 26, 1, 63])
    assert from_rendering(prior, close, 0, 1, moved) is None


def test_a_shape_is_learnt_only_where_the_dummies_and_the_count_agree() -> None:
    close = (2, 26)
    prior = Prior({}, {}, [1, 60, 2, 26, 1, 61], [70, 2], "stop")
    ids = [1, 60, 2, 26, 1, 61, 70, 2, 26, 1, 62, 2, 26, 1, 63]
    got = Bridged(ids, ((8, 9, "turn_close"),), 9, (), close)
    assert learnt_count(prior, close, 0, got, _rendered(ids)) == 1
    # A history whose rendering has one more end-of-turn token than the prompt: the count from
    # the front finds an earlier one than the dummies' place. The shape keeps to the dummies.
    more = [1, 60, 2, 26, 2, 1, 61, 70, 2, 26, 1, 62, 2, 26, 1, 63]
    assert learnt_count(prior, close, 0, got, _rendered(more)) is None


def test_only_a_completion_that_stopped_on_its_end_of_sequence_shows_it() -> None:
    close = (2, 26)
    assert eos_in_close(Prior({}, {}, [1], [70, 2], "stop"), close) == 0
    assert eos_in_close(Prior({}, {}, [1], [70, 71], "length"), close) is None
    assert eos_in_close(Prior({}, {}, [1], [70, 0], "stop"), close) is None  # <|endoftext|>
    assert eos_in_close(Prior({}, {}, [1], [70], "stop", stop_reason="on"), close) is None
    # A stop token id of the request's: not known to be the tokenizer's end of sequence.
    assert eos_in_close(Prior({}, {}, [1], [70, 2], "stop", stop_reason=2), close) is None
    assert eos_in_close(Prior({}, {}, [1], [2, 70, 2], "stop"), close) is None
