"""Generate sent beside the request's own render (``--token-in-beside on``; docs/token-in.md,
"The whole-request check beside generate"), against the fake vLLM.

A call whose close and anchors are known sends generate as soon as its dummy renders answer,
built from the last render with the same keys; the request's own render then checks it. The
answers and records are the same as with the setting off; a render that shows another request
(other sampling, another rendering of the conversation) aborts that generation, is recorded,
and the call is sent again the ordinary way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import orjson
import pytest
from aiohttp import web

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus
from capture_proxy.schemas.token_in_extras import beside_aborted_of, segment_break_of
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn
from capture_proxy.testing.fake_vllm._http import wait_connected
from capture_proxy.testing.fake_vllm._template import encode
from tests.server.test_token_in_flow import fake, run_session
from tests.server.test_token_in_parity import SHAPES, request
from tests.support.parity import agent_view
from tests.support.proxy_harness import Proxy, chat_body, user
from tests.support.token_in import beside_counts

GENERATE = "/inference/v1/generate"


def record_view(p: Proxy) -> list[dict[str, Any]]:
    """What the store holds of each call, but its ids and times."""
    return [
        {
            "prompt": list(r.prompt_token_ids),
            "completion": list(r.completion_token_ids),
            "message": r.response,
            "finish_reason": r.finish_reason,
            "bridge_spans": r.bridge_spans,
            # The id vLLM gave the generation: the render's, or a fresh one of the same form.
            "extras": {k: v for k, v in r.extras.items() if k != "upstream_response_id"},
            "sampling": r.effective_sampling,
        }
        for r in p.calls()
    ]


async def test_a_session_is_staged_the_same_with_generate_beside_the_render(
    make_proxy: Any,
) -> None:
    off = await make_proxy(fake=fake(), token_in="on")
    on = await make_proxy(fake=fake(), token_in="on", token_in_beside="on")
    await run_session(off)
    await run_session(on)
    assert record_view(on) == record_view(off)
    assert [r["prompt_token_ids"] for r in on.fake.responses] == [
        r["prompt_token_ids"] for r in off.fake.responses
    ]
    # The last call (a tool call's result, after the tool-call turn and its appended messages
    # were anchored) went beside its render and was kept.
    assert await beside_counts(on) == {"passed": 1.0}
    assert await beside_counts(off) == {}
    open_store(on.store_url).verify()


#: The parity suite's shapes that a session can go on with (a continued final message ends
#: the conversation).
SESSION_SHAPES = [s for s in SHAPES if "continued" not in s]


async def third_call(
    make_proxy: Any, beside: str, turn: Turn, extra: Mapping[str, Any], stream: bool
) -> tuple[Proxy, dict[str, Any]]:
    """A three-call session with the shape's keys on every call (so the third call's close and
    anchors are known), the third streamed or not: the proxy and the agent's view of it."""
    p: Proxy = await make_proxy(
        fake=FakeVLLM(scale_out=True), token_in="on", token_in_beside=beside
    )
    p.fake.push(Turn("First."), Turn("Second."), turn)
    messages: list[dict[str, Any]] = [user("Tell me.")]
    for text in ("More.", "Again."):
        body = request(dict(extra), False)
        body["messages"] = messages
        answer = await (await p.chat(body)).json()
        said = answer["choices"][0]["message"]
        messages = [*messages, {"role": "assistant", "content": said["content"]}, user(text)]
    body = request(dict(extra), stream)
    body["messages"] = messages
    return p, await agent_view(p.chat, body)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("shape", SESSION_SHAPES)
async def test_a_call_sent_beside_its_render_answers_as_one_sent_after_it(
    make_proxy: Any, shape: str, stream: bool
) -> None:
    turn, extra = SHAPES[shape]
    off, off_view = await third_call(make_proxy, "off", turn, extra, stream)
    on, on_view = await third_call(make_proxy, "on", turn, extra, stream)
    assert on_view == off_view
    assert record_view(on) == record_view(off)
    assert [r.bridge_spans != () for r in on.calls()] == [False, True, True]
    assert await beside_counts(on) == {"passed": 1.0}


async def test_a_call_with_a_structured_output_waits_for_its_render(make_proxy: Any) -> None:
    """A structured output's grammar reads ``reasoning_ended``, a fact of the prompt the
    render resolves: such a call is never sent beside its render (vLLM resolves
    ``response_format`` and a required tool call into ``structured_outputs`` too; the fake,
    only the key itself)."""
    extra = {"structured_outputs": {"json": {"type": "object"}}}
    off, off_view = await third_call(make_proxy, "off", Turn('{"n": 1}'), extra, False)
    on, on_view = await third_call(make_proxy, "on", Turn('{"n": 1}'), extra, False)
    assert on_view == off_view
    assert record_view(on) == record_view(off)
    assert await beside_counts(on) == {}


class LateRender(FakeVLLM):
    """The fake with the request's own render of a long conversation (five messages or more:
    never a dummy's) answered `delay` seconds late, so generate is surely under way when it
    answers; with `drift`, that render ends with one more token (a template that writes the
    conversation's end otherwise than the dummies show)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(scale_out=True, **kwargs)
        self.delay = 0.0
        self.drift = False
        #: Refuse that render (a 400, as vLLM's for a request it will not take).
        self.refuse = False
        #: Hold each generation until its client leaves (then counted in ``aborted``).
        self.hold = False

    def _own(self, body: Mapping[str, Any]) -> bool:
        return len(body.get("messages") or ()) >= 5

    async def _render_chat(self, request: Any) -> Any:
        body = orjson.loads(await request.read())
        if self._own(body):
            await asyncio.sleep(self.delay)
            if self.refuse:
                return web.json_response(REFUSED, status=400)
        return await super()._render_chat(request)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            if self.hold and not await wait_connected(request, 10.0):
                self.aborted += 1
                return web.Response()
        except asyncio.CancelledError:  # the test server cancels a handler whose client left
            self.aborted += 1
            raise
        return await super()._generate(request)

    def _render_ids(self, body: Mapping[str, Any]) -> list[int]:
        ids = super()._render_ids(body)
        return [*ids, *encode("\n")] if self.drift and self._own(body) else ids


REFUSED = {
    "error": {"message": "bad request", "type": "BadRequestError", "param": None, "code": 400}
}


async def three_calls(p: Proxy) -> list[dict[str, Any]]:
    """Three calls of a session (the third sent beside its render, with the setting on): the
    fourth call's messages."""
    p.fake.push(Turn("First."), Turn("Second."), Turn("Third."))
    messages: list[dict[str, Any]] = [user("Tell me.")]
    for text in ("More.", "Again.", "Last."):
        answer = await (await p.chat(chat_body(*messages, temperature=0))).json()
        said = answer["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": said}, user(text)]
    return messages


async def session_with_a_late_render(
    make_proxy: Any, beside: str, stream: bool, change: str
) -> tuple[Proxy, dict[str, Any]]:
    """Three calls, then `change` (``sampling``: the model's generation config; ``prompt``: the
    template's end of the conversation) with the request's own render late; a fourth call."""
    p: Proxy = await make_proxy(fake=LateRender(), token_in="on", token_in_beside=beside)
    # Generate sent beside makes the dummy renders on every call; without it a steady call reads
    # its appended tokens from the request's own rendering, where the drift below is the
    # template's own ending (`_steady`). Compared as the setting on reads them.
    p.state.pipeline.close_renders.steady = False
    messages = await three_calls(p)
    assert isinstance(p.fake, LateRender)
    p.fake.delay = 0.2
    if change == "sampling":
        p.fake.generation_config["repetition_penalty"] = 1.1
    else:
        p.fake.drift = True
    # With the setting on, the generation sent beside the render takes the first answer.
    p.fake.push(*((Turn("Aborted answer."),) if beside == "on" else ()), Turn("Kept answer."))
    body = chat_body(*messages, temperature=0, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return p, await agent_view(p.chat, body)


@pytest.mark.parametrize("change", ["sampling", "prompt"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_render_that_shows_another_request_aborts_the_generation_and_sends_it_again(
    make_proxy: Any, stream: bool, change: str
) -> None:
    off, off_view = await session_with_a_late_render(make_proxy, "off", stream, change)
    on, on_view = await session_with_a_late_render(make_proxy, "on", stream, change)
    # The client got the generation sent again, as with the setting off; nothing of the first.
    assert on_view == off_view
    text = orjson.dumps(on_view).decode()
    assert "Kept answer." in text
    assert "Aborted" not in text
    generated = [r for r in on.fake.responses if r["stream"] == stream][-2:]
    first, kept = generated
    assert kept["completion_token_ids"] != first["completion_token_ids"]
    *_, last = on.calls()
    assert list(last.completion_token_ids) == kept["completion_token_ids"]
    assert list(last.prompt_token_ids) == kept["prompt_token_ids"]
    # Recorded, with its reason, and counted; the rest of the record is the ordinary call's.
    aborted = beside_aborted_of(last.extras)
    assert aborted is not None
    assert aborted.reason == change
    assert await beside_counts(on) == {"passed": 1.0, change: 1.0}  # the third call passed
    without = [dict(r) for r in record_view(on)]
    without[-1]["extras"] = {
        k: v for k, v in without[-1]["extras"].items() if k != "token_in_beside_aborted"
    }
    assert without == record_view(off)
    cut = segment_break_of(last.extras)
    if change == "prompt":
        assert cut is not None
        assert cut.reason == "template_not_bridgeable"
        assert kept["prompt_token_ids"][-1:] == encode("\n")
    else:
        assert cut is None
        assert last.effective_sampling is not None
        assert last.effective_sampling["repetition_penalty"] == 1.1
        sent = [r for r in on.fake.requests if "token_ids" in r][-1]
        assert sent["sampling_params"]["repetition_penalty"] == 1.1
    # What a reader takes: every digest holds, the trajectory is the ordinary call's.
    store = open_store(on.store_url)
    store.verify()
    traj = store.trajectory("r1", include_open=True)
    ordinary = open_store(off.store_url).trajectory("r1", include_open=True)
    assert [len(s.call_ids) for s in traj.segments] == [len(s.call_ids) for s in ordinary.segments]
    assert traj.loss_mask == ordinary.loss_mask


@pytest.mark.parametrize(
    ("change", "after"),
    [("sampling", {"passed": 1.0, "sampling": 1.0}), ("prompt", {"passed": 2.0, "prompt": 1.0})],
)
async def test_after_an_abort_for_the_server_the_same_keys_wait_for_their_render(
    make_proxy: Any, change: str, after: dict[str, float]
) -> None:
    """Another sampling is the server's: the next call with the same keys is not sent beside
    its render. Another rendering is the call's: the next one is, and is kept."""
    p, _ = await session_with_a_late_render(make_proxy, "on", False, change)
    assert isinstance(p.fake, LateRender)
    p.fake.drift = False
    *_, last = p.calls()
    messages = [*last.request["messages"], last.response, user("Once more.")]
    p.fake.push(Turn("Fifth."))
    resp = await p.chat(chat_body(*messages, temperature=0))
    assert resp.status == 200
    assert await beside_counts(p) == after
    assert p.calls()[-1].bridge_spans


async def test_a_refused_render_aborts_the_generation_sent_beside_and_is_relayed(
    make_proxy: Any,
) -> None:
    p: Proxy = await make_proxy(fake=LateRender(), token_in="on", token_in_beside="on")
    messages = await three_calls(p)
    assert isinstance(p.fake, LateRender)
    p.fake.delay, p.fake.refuse = 0.2, True
    p.fake.push(Turn("Never seen."))
    resp = await p.chat(chat_body(*messages, temperature=0))
    assert resp.status == 400
    assert await resp.json() == REFUSED  # vLLM's error, as the chat route would give it
    (entry,) = p.failures()
    assert (entry.status, entry.reason) == (CallStatus.UPSTREAM_ERROR, "upstream_400")
    assert len(p.calls()) == 3  # nothing of the generation sent beside was staged
    assert p.fake.responses[-1]["completion_token_ids"]  # it had started


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_client_leaving_during_the_check_aborts_the_generation_sent_beside(
    make_proxy: Any, stream: bool
) -> None:
    p: Proxy = await make_proxy(fake=LateRender(), token_in="on", token_in_beside="on")
    messages = await three_calls(p)
    assert isinstance(p.fake, LateRender)
    p.fake.delay, p.fake.hold = 0.5, True  # the render late, the generation held
    p.fake.push(Turn("Never seen."))
    body = chat_body(*messages, temperature=0, stream=stream)
    with pytest.raises(TimeoutError):  # even a stream's headers wait for the check
        await asyncio.wait_for(p.chat(body), 0.2)
    for _ in range(100):
        if p.failures() and p.fake.aborted:
            break
        await asyncio.sleep(0.05)
    (entry,) = p.failures()
    assert (entry.status, entry.reason) == (CallStatus.ABORTED, "client_disconnected")
    assert p.fake.aborted == 1
    assert len(p.calls()) == 3
