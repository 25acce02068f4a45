"""Token-in through the real proxy with a Llama-2-style template, against the fake vLLM
(``FakeVLLM(chat_template="llama2")``): an assistant turn closes with a plain token, a space,
before the end-of-sequence token ``<|im_end|>``, which the model samples without the space
(docs/token-in.md, "What the model sees")."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.schemas.token_in_extras import plain_divergence_of, segment_break_of
from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
from capture_proxy.testing.fake_vllm._template import IM_END, SPECIAL_TOKENS, encode
from tests.server.test_token_in_flow import SYSTEM, TOOLS, ask, tool_result
from tests.server.test_token_in_parity import LS, through
from tests.server.test_token_in_parity import TOOLS as PARITY_TOOLS
from tests.server.test_token_in_parity import request as parity_request
from tests.support.proxy_harness import Proxy, chat_body, user

SPACE = encode(" ")
ENDOFTEXT = SPECIAL_TOKENS["<|endoftext|>"]


def llama2() -> FakeVLLM:
    return FakeVLLM(scale_out=True, chat_template="llama2")


def assert_extends(records: list[StagedCallRecord]) -> None:
    for before, after in itertools.pairwise(records):
        sent = list(before.prompt_token_ids) + list(before.completion_token_ids)
        assert list(after.prompt_token_ids[: len(sent)]) == sent


def spans(record: StagedCallRecord, after: StagedCallRecord) -> list[tuple[list[int], str]]:
    """`record`'s bridge spans as (the tokens inserted, reason), and checks they come right
    after `after`'s prompt + completion."""
    start = len(after.prompt_token_ids) + len(after.completion_token_ids)
    out = []
    for s, e, reason in record.bridge_spans:
        assert s == start
        out.append((list(record.prompt_token_ids[s:e]), reason))
    return out


async def test_a_llama2_session_is_one_segment_with_the_close_placed_once(
    make_proxy: Any,
) -> None:
    """Five calls, streamed and not: a tool call and a final answer that stop on the sampled
    `<|im_end|>` (nothing inserted: the template's space comes before it, never after), an
    answer cut by `length` (the whole close, the space then `<|im_end|>`, once), and one
    that sampled the space itself before being cut (only `<|im_end|>` after it)."""
    p: Proxy = await make_proxy(fake=llama2(), token_in="on")
    p.fake.push(
        Turn(tool_calls=[FakeToolCall("bash", {"command": "ls"})]),
        Turn(content="There are two files."),
        Turn(content="A long answer that goes on and on."),
        Turn(content="Cut after a space "),
        Turn(content="Done."),
    )
    messages: list[dict[str, Any]] = [SYSTEM, user("What is in this folder?")]
    status, replayed, _ = await ask(p, messages, stream=True)
    assert status == "staged"
    messages += [replayed, tool_result(replayed["tool_calls"][0], "a.py\nb.py")]
    status, replayed, _ = await ask(p, messages, stream=False)
    assert status == "staged"
    messages += [replayed, user("Tell me more.")]
    resp = await p.chat(chat_body(*messages, tools=TOOLS, max_tokens=10))
    assert resp.status == 200, await resp.text()
    cut = (await resp.json())["choices"][0]
    assert cut["finish_reason"] == "length"
    messages += [{"role": "assistant", "content": cut["message"]["content"]}, user("Go on.")]
    resp = await p.chat(chat_body(*messages, tools=TOOLS, max_tokens=len("Cut after a space ")))
    assert resp.status == 200, await resp.text()
    spaced = (await resp.json())["choices"][0]
    assert spaced["message"]["content"] == "Cut after a space "
    messages += [{"role": "assistant", "content": spaced["message"]["content"]}, user("End.")]
    status, replayed, _ = await ask(p, messages, stream=True)
    assert status == "staged"
    assert replayed["content"] == "Done."

    records = p.calls()
    assert [r.finish_reason for r in records] == ["tool_calls", "stop", "length", "length", "stop"]
    assert all(r.token_in for r in records)
    assert [list(r.completion_token_ids[-1:]) for r in records[:2]] == [[IM_END], [IM_END]]
    assert_extends(records)
    assert [segment_break_of(r.extras) for r in records[1:]] == [None] * 4
    # Stopped on `<|im_end|>`: nothing follows it in the close, so nothing is inserted.
    assert spans(records[1], records[0]) == []
    assert spans(records[2], records[1]) == []
    # Cut by `length`: the whole close, once, as added by the proxy.
    assert spans(records[3], records[2]) == [([*SPACE, IM_END], "end_of_turn_added")]
    # Cut right after a sampled space: the close's start, so only `<|im_end|>` follows it.
    assert list(records[3].completion_token_ids[-1:]) == SPACE
    assert spans(records[4], records[3]) == [([IM_END], "turn_close")]
    # The generate calls were sent the recorded prompts; no `<|im_end|>` was ever doubled.
    assert [g["prompt_token_ids"] for g in p.fake.responses] == [
        list(r.prompt_token_ids) for r in records
    ]
    for r in records:
        ids = list(r.prompt_token_ids)
        assert all(a != IM_END or b != IM_END for a, b in itertools.pairwise(ids))
    # The plain rendering writes a space the model did not sample before each `<|im_end|>`
    # (and strips what it did): token-in kept the sampled tokens.
    measured = [plain_divergence_of(r.extras) for r in records[1:]]
    assert all(m[0] and m[1] is not None for m in measured)
    store = open_store(p.store_url)
    store.verify()
    traj = store.trajectory("r1", include_open=True)
    assert len(traj.segments) == 1
    assert traj.drift == []


async def test_the_same_llama2_session_without_token_in_drifts(make_proxy: Any) -> None:
    p: Proxy = await make_proxy(fake=llama2())
    p.fake.push(Turn(content="Two files."), Turn(content="Done."))
    messages: list[dict[str, Any]] = [SYSTEM, user("What is in this folder?")]
    status, replayed, _ = await ask(p, messages, stream=False)
    assert status == "staged"
    status, _, _ = await ask(p, [*messages, replayed, user("And?")], stream=False)
    assert status == "staged"
    traj = open_store(p.store_url).trajectory("r1", include_open=True)
    # The replayed answer renders " Two files. <|im_end|>": a space the model never sampled.
    assert len(traj.segments) == 2
    assert traj.drift


async def test_a_llama2_answer_that_stopped_on_another_stop_token_is_not_bridged(
    make_proxy: Any,
) -> None:
    """The model ended on `<|endoftext|>`, which the close ` <|im_end|>` does not hold: the
    next call starts a new segment (`stopped_on_other_token`), never `<|endoftext|>` then a
    whole close; the agent's answer shows neither token."""
    p: Proxy = await make_proxy(fake=llama2(), token_in="on")
    p.fake.push(Turn(content="Other end.", stop_token="<|endoftext|>"), Turn(content="Next."))
    messages: list[dict[str, Any]] = [SYSTEM, user("Hi.")]
    status, replayed, answer = await ask(p, messages, stream=False)
    assert status == "staged"
    assert replayed["content"] == "Other end."
    assert answer["choices"][0]["finish_reason"] == "stop"
    status, _, _ = await ask(p, [*messages, replayed, user("And?")], stream=False)
    assert status == "staged"
    before, after = p.calls()
    assert before.completion_token_ids[-1] == ENDOFTEXT
    cut = segment_break_of(after.extras)
    assert cut is not None
    assert cut.reason == "stopped_on_other_token"
    assert str(ENDOFTEXT) in cut.detail
    assert not after.bridge_spans
    assert after.token_in  # sent the plain way, staged with token-in's fields
    assert list(after.prompt_token_ids) == p.fake.tokenize_chat(
        [*messages, replayed, user("And?")], TOOLS
    )


#: Shapes of the parity suite (tests/server/test_token_in_parity.py) through the Llama-2-style
#: template: the same scripted answer on the plain path and token-in, field by field.
LLAMA2_SHAPES: dict[str, tuple[Turn, dict[str, Any]]] = {
    "plain": (Turn("Done."), {}),
    "trailing space": (Turn("Done. "), {}),
    "other stop token": (Turn("Done.", stop_token="<|endoftext|>"), {}),
    "stop string": (Turn("Done. Gone."), {"stop": ["on"]}),
    "tool call": (Turn(tool_calls=[LS]), {"tools": PARITY_TOOLS}),
    "length mid content": (Turn("a long answer indeed"), {"max_tokens": 7}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
@pytest.mark.parametrize("shape", list(LLAMA2_SHAPES))
async def test_token_in_answers_what_the_chat_route_answers_with_a_llama2_template(
    make_proxy: Any, shape: str, stream: bool
) -> None:
    turn, extra = LLAMA2_SHAPES[shape]
    body = parity_request(extra, stream)
    plain = await through(make_proxy, "off", turn, body, chat_template="llama2")
    token_in = await through(make_proxy, "on", turn, body, chat_template="llama2")
    assert token_in == plain
