"""A token-in call's prompt (`core/token_in/_bridging.py`): the renders sent to the fake vLLM over
HTTP, the turn-close cache, the lines of calls, and the output limit of a longer prompt."""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from capture_proxy.adapters.vllm import read_render
from capture_proxy.adapters.vllm._render import compact_sampling
from capture_proxy.core.token_in import (
    CloseRenders,
    Prior,
    PromptJson,
    RenderRefused,
    TokenInPrompt,
    token_in_line,
    token_in_prompt,
)
from capture_proxy.core.transport import EngineRoute
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn
from capture_proxy.testing.fake_vllm._template import IM_END, encode
from capture_proxy.upstream.http import HTTPUpstream
from tests.support.token_in import continued, render_ids, served, tool_turns

RENDER = "/v1/chat/completions/render"
SYSTEM = {"role": "system", "content": "Be terse."}


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[FakeVLLM, HTTPUpstream]]:
    fake = FakeVLLM(scale_out=True, drop_past_reasoning=True)
    server = TestServer(fake.app())
    await server.start_server()
    client = HTTPUpstream(str(server.make_url("")))
    try:
        yield fake, client
    finally:
        await client.close()
        await server.close()


def _prior(*messages: dict[str, Any]) -> Prior:
    request = {"model": "policy", "messages": list(messages)}
    # A completion that stopped ends on the end-of-turn token the model sampled.
    return Prior(request, _ANSWER, render_ids(request), [*encode("Yes."), IM_END], "stop")


_ANSWER = {"role": "assistant", "content": "Yes."}


async def test_an_extension_renders_the_plan_beside_the_request_and_caches_the_close(
    upstream: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    fake, client = upstream
    closes = CloseRenders()
    prior = _prior(SYSTEM, {"role": "user", "content": "One?"})
    request = {
        **prior.request,
        "messages": [*prior.request["messages"], _ANSWER, {"role": "user", "content": "Two?"}],
    }
    got = await token_in_prompt(client, closes, prior, request, request)
    assert got.segment_break is None
    sent = [*prior.prompt_ids, *prior.completion_ids]
    assert got.prompt_ids[: len(sent)] == sent
    assert fake.route_hits[RENDER] == 5  # the request, and the plan's close and suffix pairs
    assert len(closes) == 1
    again = await token_in_prompt(client, closes, prior, request, request)
    # The close came from the cache, and the first call learnt where this shape's appended
    # tokens start in the request's own rendering: that render alone (`_steady`).
    assert fake.route_hits[RENDER] == 5 + 1
    assert (again.prompt_ids, again.bridge_spans) == (got.prompt_ids, got.bridge_spans)
    assert again.plain_divergence == got.plain_divergence


async def test_a_call_that_does_not_extend_sends_the_plain_ids_with_the_reason(
    upstream: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    fake, client = upstream
    prior = _prior(SYSTEM, {"role": "user", "content": "One?"})
    request = {"model": "policy", "messages": [SYSTEM, {"role": "user", "content": "Other?"}]}
    got = await token_in_prompt(client, CloseRenders(), prior, request, request)
    assert got.segment_break is not None
    assert got.segment_break.reason == "history_edited"
    assert got.prompt_ids == render_ids(request)
    assert (got.bridge_spans, got.plain_divergence) == ((), None)
    assert fake.route_hits[RENDER] == 1


async def test_a_request_vllm_will_not_render_is_its_answer(
    upstream: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    _, client = upstream
    request = {"model": "other-model", "messages": [{"role": "user", "content": "a"}]}
    with pytest.raises(RenderRefused) as refused:
        await token_in_prompt(client, CloseRenders(), None, request, request)
    assert refused.value.status == 404
    assert b"other-model" in refused.value.body


def test_a_longer_bridged_prompt_gets_less_room_only_when_the_request_set_no_limit() -> None:
    answer = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 100, "temperature": 0.0}}
    rendered = read_render(orjson.dumps(answer))
    prompt = TokenInPrompt(rendered, [1, 2, 3, 4, 5])
    body = orjson.loads(prompt.generate_body({}, stream=False))
    assert body["sampling_params"]["max_tokens"] == 98
    assert body["token_ids"] == [1, 2, 3, 4, 5]
    body = orjson.loads(prompt.generate_body({"max_tokens": 100}, stream=True))
    assert body["sampling_params"]["max_tokens"] == 100
    assert body["stream"] is True


def test_the_turn_close_cache_keeps_the_most_recent() -> None:
    closes = CloseRenders(limit=2)
    for key in ("a", "b", "c"):
        closes.put(key, ([1], [2]))
    assert closes.get("a") is None
    assert closes.get("c") is not None
    closes.clear()
    assert len(closes) == 0


def test_a_side_call_is_a_line_of_its_own() -> None:
    tools = [{"type": "function", "function": {"name": "bash"}}]
    loop = {
        "model": "policy",
        "tools": tools,
        "messages": [SYSTEM, {"role": "user", "content": "a"}],
    }
    later = {**loop, "messages": [*loop["messages"], _ANSWER, {"role": "user", "content": "b"}]}
    title = {"model": "policy", "messages": [{"role": "system", "content": "Title?"}]}
    assert token_in_line(loop) == token_in_line(later)
    assert token_in_line(title) != token_in_line(loop)
    assert token_in_line({**loop, "tools": []}) != token_in_line(loop)


async def test_a_bridge_render_answer_without_a_list_of_ids_is_not_bridgeable() -> None:
    async def render(request: web.Request) -> web.Response:
        body = await request.json()
        dummy = body["messages"][1:2] == [{"role": "user", "content": "u"}]
        answer = {"token_ids": [1, "x"]} if dummy else {"token_ids": [1, 2, 3]}
        return web.json_response({**answer, "sampling_params": {"max_tokens": 5}})

    app = web.Application()
    app.router.add_post(RENDER, render)
    server = TestServer(app)
    await server.start_server()
    client = HTTPUpstream(str(server.make_url("")))
    prior = _prior(SYSTEM, {"role": "user", "content": "One?"})
    request = {
        **prior.request,
        "messages": [*prior.request["messages"], _ANSWER, {"role": "user", "content": "Two?"}],
    }
    closes = CloseRenders()
    try:
        got = await token_in_prompt(client, closes, prior, request, request)
    finally:
        await client.close()
        await server.close()
    assert got.segment_break is not None
    assert got.segment_break.reason == "template_not_bridgeable"
    assert got.segment_break.detail.startswith("a render of the bridge: ")
    assert "token_ids" in got.segment_break.detail
    assert got.prompt_ids == [1, 2, 3]
    assert len(closes) == 0  # nothing cached from answers that were refused


async def test_a_bridged_prompt_s_json_extends_the_prior_s_kept_json(
    upstream: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    _, client = upstream
    prior = _prior(SYSTEM, {"role": "user", "content": "One?"})
    request = {
        **prior.request,
        "messages": [*prior.request["messages"], _ANSWER, {"role": "user", "content": "Two?"}],
    }
    prompts = PromptJson()
    # Kept with spaces, as vLLM's JSON may come: the extension copies it as it is.
    prompts.put(prior.prompt_ids, orjson.dumps(list(prior.prompt_ids)).replace(b",", b", "))
    got = await token_in_prompt(client, CloseRenders(), prior, request, request, prompts)
    assert got.prompt_json.startswith(b"[" + str(prior.prompt_ids[0]).encode() + b", ")
    assert orjson.loads(got.prompt_json) == got.prompt_ids
    body = orjson.loads(got.generate_body(request, stream=False))
    assert body["token_ids"] == got.prompt_ids
    # Without the prior's JSON kept, the whole prompt is encoded.
    fresh = await token_in_prompt(client, CloseRenders(), prior, request, request, PromptJson())
    assert fresh.prompt_json == orjson.dumps(got.prompt_ids)


async def test_a_plain_prompt_is_sent_as_the_render_answer_s_json(
    upstream: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    _, client = upstream
    request = {"model": "policy", "messages": [SYSTEM, {"role": "user", "content": "One?"}]}
    got = await token_in_prompt(client, CloseRenders(), None, request, request, PromptJson())
    assert got.prompt_json is got.rendered.ids_json
    assert orjson.loads(got.prompt_json) == got.prompt_ids == render_ids(request)


def test_kept_prompt_json_is_found_by_the_same_ids_object_and_bounded_by_bytes() -> None:
    first, second = [1, 2, 3], [1, 2, 3]
    prompts = PromptJson(max_bytes=2 * (len(b"[1,2,3]") + 4 * 3))
    prompts.put(first, b"[1,2,3]")
    assert prompts.get(first) == b"[1,2,3]"
    assert prompts.get(second) is None  # equal ids, another object: not this call's prompt
    prompts.put(second, b"[1,2,3]")
    prompts.put([4], b"[4]")  # over the bound: the least recently used goes
    assert (prompts.get(first), prompts.get(second), len(prompts)) == (None, b"[1,2,3]", 2)
    prompts.put(list(range(100)), orjson.dumps(list(range(100))))  # alone over it: not kept
    assert len(prompts) == 2


async def test_a_bridged_prompt_s_array_extends_a_staged_prior_s_array(
    upstream: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    _, client = upstream
    listed = _prior(SYSTEM, {"role": "user", "content": "One?"})
    request = {
        **listed.request,
        "messages": [*listed.request["messages"], _ANSWER, {"role": "user", "content": "Two?"}],
    }
    # A staged call's prior has its prompt ids as the record's int32 array.
    prior = dataclasses.replace(listed, prompt_ids=array("i", listed.prompt_ids))
    got = await token_in_prompt(client, CloseRenders(), prior, request, request)
    assert got.ids_array is not None
    assert got.prompt_array == array("i", got.prompt_ids)
    assert got.prompt_array is not prior.prompt_ids
    assert prior.prompt_ids == array("i", listed.prompt_ids)  # the prior's own, unchanged
    # Ids in a list: converted when asked for.
    plain = await token_in_prompt(client, CloseRenders(), listed, request, request)
    assert (plain.ids_array, plain.prompt_array) == (None, array("i", plain.prompt_ids))


def _imaged(n: int) -> dict[str, Any]:
    return {
        "token_ids": [9] * n,
        "sampling_params": {"max_tokens": 10},
        "features": {
            "mm_hashes": {"image": [f"{i:064x}" for i in range(n)]},
            "mm_placeholders": {"image": [{"offset": i, "length": 1} for i in range(n)]},
            "kwargs_data": {"image": ["AAAA"] * n},
            "mm_metadata": None,
        },
    }


def test_a_prompts_image_placeholders_are_kept_up_to_a_byte_bound() -> None:
    few = TokenInPrompt(read_render(orjson.dumps(_imaged(3))), [9] * 3)
    assert few.media is not None
    assert [(m.hash[-1], m.offset) for m in few.media] == [("0", 0), ("1", 1), ("2", 2)]
    # 85 bytes an image: past 64 KiB of them, none is kept (the next call goes plain).
    many = TokenInPrompt(read_render(orjson.dumps(_imaged(800))), [9] * 800)
    assert many.media is None
    text = TokenInPrompt(read_render(orjson.dumps({"token_ids": [1]})), [1])
    assert text.media == ()


def test_a_bridged_prompt_with_images_sends_its_own_features() -> None:
    rendered = read_render(orjson.dumps(_imaged(1)))
    features = {**rendered.features, "mm_placeholders": {"image": [{"offset": 4, "length": 1}]}}
    prompt = TokenInPrompt(rendered, [1, 2, 3, 4, 9], features=features)
    body = orjson.loads(prompt.generate_body({}, stream=False))
    assert body["features"] == features
    assert body["token_ids"] == [1, 2, 3, 4, 9]
    plain = TokenInPrompt(rendered, [9])
    assert orjson.loads(plain.generate_body({}, stream=False))["features"] == rendered.features


async def test_later_calls_render_each_dummy_once_and_bridge_as_the_pairs_do(
    upstream: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    fake, client = upstream
    shared = CloseRenders(steady=False)  # every bridged call makes its dummy renders
    for k, (prior, request) in enumerate(tool_turns(4)):
        before = fake.route_hits[RENDER]
        got = await token_in_prompt(client, shared, prior, request, request)
        sent = fake.route_hits[RENDER] - before
        # The first call: the request, the close, tool-call turn and suffix pairs. Later ones:
        # the request and one render each of the turn and the suffix, read against the
        # anchors the first call's pairs showed.
        assert sent == (7 if k == 0 else 3)
        paired = await token_in_prompt(client, CloseRenders(), prior, request, request)
        assert got.segment_break is None
        assert (got.prompt_ids, got.bridge_spans) == (paired.prompt_ids, paired.bridge_spans)
        assert got.plain_divergence == paired.plain_divergence


class _SystemCountsUsers(FakeVLLM):
    """A template whose first message says how many user messages there are: a dummy
    conversation's tokens before its content then depend on the messages after it."""

    def _render(self, messages: Any, tools: Any, gen: bool) -> str:
        users = sum(1 for m in messages if m.get("role") == "user")
        first = {**messages[0], "content": f"{messages[0]['content']} ({users} user turns)"}
        return super()._render([first, *messages[1:]], tools, gen)


class _NumbersUsers(FakeVLLM):
    """A template that numbers user messages across the conversation: the tokens of appended
    messages then depend on the history, which the dummy conversation does not have."""

    def _render(self, messages: Any, tools: Any, gen: bool) -> str:
        numbered, n = [], 0
        for m in messages:
            if m.get("role") == "user":
                n += 1
                m = {**m, "content": f"[{n}] {m['content']}"}
            numbered.append(m)
        return super()._render(numbered, tools, gen)


async def test_a_single_render_that_does_not_start_as_its_pair_is_bridged_from_the_pair() -> None:
    fake = _SystemCountsUsers(scale_out=True, drop_past_reasoning=True)
    async with served(fake) as client:
        closes = CloseRenders(steady=False)
        prior = _prior(SYSTEM, {"role": "user", "content": "One?"})
        first = continued(prior, _ANSWER, {"role": "user", "content": "Two?"})
        await token_in_prompt(client, closes, prior, first, first)  # learns the anchor
        # Two user messages appended: the dummy's first message counts three users, not two.
        two = {**first, "messages": [*first["messages"], {"role": "user", "content": "Three?"}]}
        before = fake.route_hits[RENDER]
        got = await token_in_prompt(client, closes, prior, two, two)
        # The request and the suffix's single render, then the rest of its pair.
        assert fake.route_hits[RENDER] - before == 3
        paired = await token_in_prompt(client, CloseRenders(), prior, two, two)
        assert got.segment_break is None
        assert (got.prompt_ids, got.bridge_spans) == (paired.prompt_ids, paired.bridge_spans)
        # The kind is rendered as pairs from now on.
        before = fake.route_hits[RENDER]
        await token_in_prompt(client, closes, prior, first, first)
        assert fake.route_hits[RENDER] - before == 3


async def test_appended_tokens_the_request_s_own_rendering_does_not_end_with_are_not_sent() -> None:
    fake = _NumbersUsers(scale_out=True, drop_past_reasoning=True)
    async with served(fake) as client:
        history = [
            SYSTEM,
            {"role": "user", "content": "Zero?"},
            {"role": "assistant", "content": "Ok."},
        ]
        prior = _prior(*history, {"role": "user", "content": "One?"})
        more = {"role": "user", "content": "Two?"}
        request = continued(prior, _ANSWER, more)
        got = await token_in_prompt(client, CloseRenders(), prior, request, request)
        # The dummy conversation renders "[2] Two?", the conversation itself "[3] Two?": the
        # bridge does not send tokens the template does not write there.
        assert got.segment_break is not None
        assert got.segment_break.reason == "template_not_bridgeable"
        assert "does not end with the turn close and the appended" in got.segment_break.detail
        assert got.prompt_ids == encode(fake._render(request["messages"], None, True))
        assert (got.bridge_spans, got.plain_divergence) == ((), None)


class _FailsOnce(FakeVLLM):
    """Answers one dummy render with a 500 when `fail` is set (an upstream hiccup)."""

    fail = False

    async def _render_chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        dummy = any(m.get("content") == "A" for m in body["messages"])
        if self.fail and dummy:
            self.fail = False
            self.route_hits[request.path] += 1
            return web.json_response({"error": {"message": "busy"}}, status=500)
        return await super()._render_chat(request)


async def test_a_single_render_that_fails_is_a_break_as_with_pairs_and_keeps_its_anchor() -> None:
    fake = _FailsOnce(scale_out=True, drop_past_reasoning=True)
    async with served(fake) as client:
        closes = CloseRenders(steady=False)
        prior = _prior(SYSTEM, {"role": "user", "content": "One?"})
        request = continued(prior, _ANSWER, {"role": "user", "content": "Two?"})
        first = await token_in_prompt(client, closes, prior, request, request)
        fake.fail = True
        before = fake.route_hits[RENDER]
        got = await token_in_prompt(client, closes, prior, request, request)
        # The request and the suffix's single render (answered 500), then the rest of its
        # pair: a render of the bridge that fails is a break, as with pairs alone.
        assert fake.route_hits[RENDER] - before == 3
        assert got.segment_break is not None
        assert got.segment_break.reason == "template_not_bridgeable"
        assert "a render of the bridge answered 500" in got.segment_break.detail
        assert got.prompt_ids == render_ids(request)
        # Not the template's doing: the next call renders the suffix once, and is bridged.
        before = fake.route_hits[RENDER]
        again = await token_in_prompt(client, closes, prior, request, request)
        assert fake.route_hits[RENDER] - before == 2
        assert (again.segment_break, again.prompt_ids) == (None, first.prompt_ids)


def test_the_appended_tokens_must_start_right_after_the_close_in_the_request_s_rendering() -> None:
    from capture_proxy.core.token_in import Bridged
    from capture_proxy.core.token_in._bridging import _appended_as_rendered

    close, appended = [2, 26], [1, 131, 9, 2, 26, 1, 113]
    plain = read_render(orjson.dumps({"token_ids": [5, 6, 7, *close, *appended]}))

    def bridged(tokens: list[int]) -> Bridged:
        # The model's own turn (its end-of-turn token first), the close's rest, `tokens`.
        prompt = [50, 60, 70, 80, *close, *tokens]
        return Bridged(prompt, (), len(prompt) - len(tokens), (), tuple(close))

    assert _appended_as_rendered(bridged(appended), plain)
    # Appended tokens that take in one of the close's (or leave out their first) end as the
    # request's rendering does, but do not start right after its close.
    assert not _appended_as_rendered(bridged([26, *appended]), plain)
    assert not _appended_as_rendered(bridged(appended[1:]), plain)
    # Appended tokens the request's own rendering does not end with.
    assert not _appended_as_rendered(bridged([*appended[:-1], 114]), plain)


def test_a_llama2_close_the_model_ended_inside_is_checked_as_the_template_writes_it() -> None:
    # Llama-2 closes with " </s>" (here 48, then 2); the model sampled </s> without the space:
    # the bridged prompt has [..., 2, appended], the request's rendering [..., 48, 2, appended].
    from capture_proxy.core.token_in import Bridged
    from capture_proxy.core.token_in._bridging import _appended_as_rendered

    close, appended = (48, 2), [50, 51, 52]
    plain = read_render(orjson.dumps({"token_ids": [5, 6, 7, *close, *appended]}))
    prompt = [5, 6, 7, 2, *appended]
    assert _appended_as_rendered(Bridged(prompt, (), 4, (), close), plain)
    assert not _appended_as_rendered(Bridged([*prompt[:-1], 53], (), 4, (), close), plain)
    # The answer's content is empty to the template (reasoning alone): it writes "  </s>", whose
    # two spaces the tokenizer merges into one token (here 300). The bridged prompt has the
    # model's tokens (69, 69) and the whole close after them: it is checked from </s> on.
    merged = read_render(orjson.dumps({"token_ids": [5, 6, 7, 300, 2, *appended]}))
    cut = [5, 6, 7, 69, 69, *close, *appended]
    assert _appended_as_rendered(Bridged(cut, (), 7, (), close), merged)
    assert not _appended_as_rendered(Bridged([*cut[:-1], 53], (), 7, (), close), merged)
    elsewhere = read_render(orjson.dumps({"token_ids": [5, 6, 7, 300, 3, *appended]}))
    assert not _appended_as_rendered(Bridged(cut, (), 7, (), close), elsewhere)


class _Recording(FakeVLLM):
    """Keeps every render request's body."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.renders: list[dict[str, Any]] = []

    async def _render_chat(self, request: web.Request) -> web.Response:
        self.renders.append(await request.json())
        return await super()._render_chat(request)


class _ToolsMarkResults(_Recording):
    """A template that writes how many tools are defined into each tool result: the appended
    messages' tokens depend on the tools, which lean dummies leave out."""

    def _render(self, messages: Any, tools: Any, gen: bool) -> str:
        mark = f"[{len(tools or ())} tools] "
        marked = [
            {**m, "content": mark + m["content"]} if m.get("role") == "tool" else m
            for m in messages
        ]
        return super()._render(marked, tools, gen)


def _dummies(renders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for b in renders if any(m.get("content") in ("A", "B") for m in b["messages"])]


async def test_the_turn_and_suffix_dummies_leave_out_the_system_prompt_and_tools() -> None:
    fake = _Recording(scale_out=True, drop_past_reasoning=True)
    async with served(fake) as client:
        closes = CloseRenders(steady=False)
        for prior, request in tool_turns(2):
            got = await token_in_prompt(client, closes, prior, request, request)
            paired = await token_in_prompt(client, CloseRenders(), prior, request, request)
            assert got.segment_break is None
            assert got.prompt_ids == paired.prompt_ids
        dummies = _dummies(fake.renders)
        # The close pair has them (once, cached); every other dummy has neither.
        with_context = [b for b in dummies if "tools" in b or b["messages"][0] == SYSTEM]
        assert len(with_context) == 3 * 2  # the close pair of each cache (one shared)
        assert all(b["add_generation_prompt"] is False for b in with_context)
        assert all(b["messages"][-1]["content"] in ("A", "B") for b in with_context)
        # Shared cache: the turn and suffix pairs, then one render of each; two fresh caches:
        # both pairs each.
        assert len(dummies) - len(with_context) == (4 + 2) + 2 * 4


async def test_a_template_that_needs_the_tools_in_the_dummies_gets_them() -> None:
    fake = _ToolsMarkResults(scale_out=True, drop_past_reasoning=True)
    async with served(fake) as client:
        closes = CloseRenders(steady=False)
        turns = tool_turns(3)
        prior, request = turns[0]
        got = await token_in_prompt(client, closes, prior, request, request)
        # The lean dummies' "[0 tools] file0.py" is not the request's "[1 tools] file0.py":
        # the dummies with the system prompt and tools decide, and are bridged.
        assert got.segment_break is None
        assert got.prompt_ids[-40:] == render_ids_of(fake, request)[-40:]
        # From then on this template's dummies have them: one render each of the turn and
        # the suffix (their anchors learnt), beside the request's.
        for prior, request in turns[1:]:
            before = len(fake.renders)
            got = await token_in_prompt(client, closes, prior, request, request)
            assert got.segment_break is None
            assert len(fake.renders) - before == 3
            assert all("tools" in b for b in fake.renders[before:])


def render_ids_of(fake: FakeVLLM, request: dict[str, Any]) -> list[int]:
    return encode(fake._render(request["messages"], request.get("tools"), True))


async def test_a_call_asking_for_16_tokens_gets_16_though_render_leaves_the_limit_out(
    upstream: tuple[FakeVLLM, HTTPUpstream],
) -> None:
    fake, client = upstream
    fake.script = lambda body: Turn("word " * 40)
    request: dict[str, Any] = {
        "model": "policy",
        "messages": [SYSTEM, {"role": "user", "content": "Talk."}],
        "max_tokens": 16,
    }
    got = await token_in_prompt(client, CloseRenders(), None, request, request)
    # vLLM's render answers no `max_tokens` for 16 (SamplingParams' default); generate would
    # take that as no limit. The proxy says it.
    assert "max_tokens" not in got.rendered.sampling_params
    body = orjson.loads(got.generate_body(request, stream=False))
    assert body["sampling_params"]["max_tokens"] == 16
    resp = await client.post_engine(EngineRoute.GENERATE, orjson.dumps(body))
    async with resp:
        answer = orjson.loads(await resp.read())
    assert len(answer["choices"][0]["token_ids"]) == 16
    assert answer["choices"][0]["finish_reason"] == "length"
    # With no limit asked, the room the render resolved is sent as before.
    del request["max_tokens"]
    room = await token_in_prompt(client, CloseRenders(), None, request, request)
    sent = orjson.loads(room.generate_body(request, stream=False))["sampling_params"]
    assert sent == compact_sampling(room.rendered.sampling_params)
    assert sent["max_tokens"] == room.rendered.sampling_params["max_tokens"]


def test_the_anchors_are_bounded_by_bytes_and_a_pairs_only_kind_learns_none() -> None:
    closes = CloseRenders(anchor_bytes=10)
    closes.learn("a", b"[1,2,3,")
    assert closes.anchor("a") == b"[1,2,3,"
    closes.learn("b", b"[4,5,6,")  # 14 bytes: the least recent goes
    assert (closes.anchor("a"), closes.anchor("b")) == (None, b"[4,5,6,")
    assert closes.learns("a")
    closes.pairs_only("b")
    assert closes.anchor("b") is None
    assert not closes.learns("b")
    closes.learn("b", b"[7,")
    assert closes.anchor("b") is None
    closes.context_needed("k")
    assert closes.needs_context("k")
    closes.clear()
    assert closes.learns("b")
    assert not closes.needs_context("k")
