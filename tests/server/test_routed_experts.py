"""Routed experts (vLLM's ``--enable-return-routed-experts``) are staged in the record's extras
and never relayed to the client, plain and streamed; each later call of a session asks only for
the positions its parent did not stage, so storage grows with the session, not its square."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from capture_proxy import ExpertsIncomplete
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.sinks.registry import open_sink
from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn, experts_for, read_experts
from tests.support.proxy_harness import Proxy, chat_body, sse_lines, start_proxy, stop_proxy, user

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("stream", [False, True])
async def test_routed_experts_are_staged_not_relayed(make_proxy: Any, stream: bool) -> None:
    p = await make_proxy(fake=FakeVLLM(routed_experts=True))
    resp = await p.chat(chat_body(user("hello"), stream=stream))
    assert resp.headers["X-Capture-Status"] == "staged" or stream
    body = b"\n".join([line async for line in sse_lines(resp)])
    assert b"routed_experts" not in body
    if not stream:
        assert "routed_experts" not in orjson.loads(body)["choices"][0]
    (record,) = p.calls()
    ids = [*record.prompt_token_ids, *record.completion_token_ids]
    _, values = read_experts(record.extras["routed_experts"])
    assert values == experts_for(ids)


def _turns(n: int) -> list[Turn]:
    """An agent session: `n` - 1 tool calls, then a final answer."""
    turns = [
        Turn(f"step {i}", reasoning=f"think {i}", tool_calls=[FakeToolCall("bash", {"n": i})])
        for i in range(n - 1)
    ]
    return [*turns, Turn("done", reasoning="all done")]


async def _session(
    p: Proxy,
    turns: int,
    *,
    history: list[dict[str, Any]] | None = None,
    replay: Any = None,
    rollout: str = "r1",
) -> list[dict[str, Any]]:
    """Run `turns` calls, each replaying the answers before it as the client received them
    (`replay` may rewrite an assistant message, as a client that re-serializes does)."""
    messages = list(history or [user("fix the bug")])
    for i in range(turns):
        resp = await p.chat(chat_body(*messages, tools=TOOLS), rollout=rollout)
        assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
        answer = (await resp.json())["choices"][0]["message"]
        message = {k: answer.get(k) for k in ("role", "content", "reasoning", "tool_calls")}
        messages.append(replay(message) if replay else message)
        for tc in answer.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": f"out {i}"})
        if not answer.get("tool_calls"):
            messages.append(user(f"and now {i}"))
    return messages


def _rows(record: StagedCallRecord) -> int:
    shape, _ = read_experts(record.extras["routed_experts"])
    return shape[0]


def _full(record: StagedCallRecord) -> list[int]:
    return [*record.prompt_token_ids, *record.completion_token_ids]


async def test_each_call_stores_only_the_experts_its_parent_did_not(make_proxy: Any) -> None:
    fake = FakeVLLM(routed_experts=True)
    fake.push(*_turns(12))
    p = await make_proxy(fake=fake)
    await _session(p, 12)
    records = p.calls()
    sent = [r.get("routed_experts_prompt_start") for r in fake.requests]
    assert sent[0] is None
    for before, record, start in zip(records, records[1:], sent[1:], strict=False):
        # Each call asked vLLM only for the positions after its parent's prompt + completion.
        assert start == len(_full(before))
        assert record.extras["routed_experts_prompt_start"] == start
        assert record.extras["routed_experts_parent_call_id"] == before.call_id
        assert "routed_experts_incomplete" not in record.extras
        _, values = read_experts(record.extras["routed_experts"])
        assert values == experts_for(_full(record), start)
    # Linear: every position of the session is stored once, not once per later call.
    final = len(_full(records[-1]))
    assert sum(_rows(r) for r in records) == final
    store = open_store(p.store_url)
    for record in records:
        full = store.routed_experts(record.call_id, include_open=True)
        assert full is not None
        assert read_experts(full)[1] == experts_for(_full(record))


async def test_large_requests_choose_their_start_off_the_event_loop(
    make_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every body counts as large: admission hashes the messages on a worker thread.
    monkeypatch.setattr("capture_proxy.core.exchange.OFFLOAD_BYTES", 0)
    fake = FakeVLLM(routed_experts=True)
    fake.push(*_turns(3))
    p = await make_proxy(fake=fake)
    await _session(p, 3)
    records = p.calls()
    assert fake.requests[2]["routed_experts_prompt_start"] == len(_full(records[1]))
    assert sum(_rows(r) for r in records) == len(_full(records[-1]))


async def test_streamed_calls_continue_their_parent_too(make_proxy: Any) -> None:
    fake = FakeVLLM(routed_experts=True)
    fake.push(*_turns(2))
    p = await make_proxy(fake=fake)
    first = await p.chat(chat_body(user("go"), tools=TOOLS))
    answer = (await first.json())["choices"][0]["message"]
    tc = answer["tool_calls"][0]
    body = chat_body(
        user("go"),
        {k: answer.get(k) for k in ("role", "content", "reasoning", "tool_calls")},
        {"role": "tool", "tool_call_id": tc["id"], "content": "ok"},
        tools=TOOLS,
        stream=True,
    )
    second = await p.chat(body)
    assert b"data: [DONE]" in [line async for line in sse_lines(second)]
    one, two = p.calls()
    assert fake.requests[1]["routed_experts_prompt_start"] == len(_full(one))
    full = open_store(p.store_url).routed_experts(two.call_id, include_open=True)
    assert full is not None
    assert read_experts(full)[1] == experts_for(_full(two))


def _compact_arguments(message: dict[str, Any]) -> dict[str, Any]:
    # OpenCode sends tool arguments back as compact JSON (docs/upstream-facts.md).
    calls = [
        {
            **tc,
            "function": {
                **tc["function"],
                "arguments": orjson.dumps(orjson.loads(tc["function"]["arguments"])).decode(),
            },
        }
        for tc in message.get("tool_calls") or ()
    ]
    return {**message, "tool_calls": calls} if calls else message


async def test_a_prompt_that_drifted_before_the_start_is_flagged(make_proxy: Any) -> None:
    fake = FakeVLLM(routed_experts=True)  # renders replayed arguments verbatim: they drift
    fake.push(*_turns(3))
    p = await make_proxy(fake=fake)
    await _session(p, 3, replay=_compact_arguments)
    one, two, three = p.calls()
    # The messages match loosely (same parsed arguments), so two continues one; its tokens
    # do not, so the gap is flagged and three asks for every position again.
    assert two.extras["routed_experts_parent_call_id"] == one.call_id
    assert two.extras["routed_experts_incomplete"] is True
    assert "routed_experts_prompt_start" not in three.extras
    assert fake.requests[2].get("routed_experts_prompt_start") is None
    assert _rows(three) == len(_full(three))
    store = open_store(p.store_url)
    with pytest.raises(ExpertsIncomplete, match="incomplete"):
        store.routed_experts(two.call_id, include_open=True)
    # Asked for anyway, the rows before the start are the parent's (routed for other tokens).
    partial = store.routed_experts(two.call_id, include_open=True, allow_incomplete=True)
    assert partial is not None
    assert read_experts(partial)[0][0] == len(_full(two))


async def test_reparsed_arguments_do_not_drift(make_proxy: Any) -> None:
    # Real vLLM + Qwen3 re-dumps replayed arguments: the compact replay renders the same tokens.
    fake = FakeVLLM(routed_experts=True, reparse_tool_arguments=True)
    fake.push(*_turns(3))
    p = await make_proxy(fake=fake)
    await _session(p, 3, replay=_compact_arguments)
    records = p.calls()
    assert not any("routed_experts_incomplete" in r.extras for r in records)
    assert sum(_rows(r) for r in records) == len(_full(records[-1]))


async def test_an_edited_history_asks_for_every_position(make_proxy: Any) -> None:
    fake = FakeVLLM(routed_experts=True)
    fake.push(*_turns(3))
    p = await make_proxy(fake=fake)
    messages = await _session(p, 2)
    messages[0] = user("fix the other bug")  # the agent rewrote its context
    resp = await p.chat(chat_body(*messages, tools=TOOLS))
    assert resp.status == 200
    third = p.calls()[-1]
    assert fake.requests[-1].get("routed_experts_prompt_start") is None
    assert "routed_experts_parent_call_id" not in third.extras
    assert _rows(third) == len(_full(third))


async def test_stock_vllm_never_gets_the_field(make_proxy: Any) -> None:
    fake = FakeVLLM()  # no --enable-return-routed-experts: routed_experts is null
    fake.push(*_turns(3))
    p = await make_proxy(fake=fake)
    await _session(p, 3)
    assert not any("routed_experts_prompt_start" in r for r in fake.requests)
    assert open_store(p.store_url).routed_experts(p.calls()[1].call_id, include_open=True) is None


async def test_a_client_start_is_kept_and_flagged(make_proxy: Any) -> None:
    p = await make_proxy(fake=FakeVLLM(routed_experts=True))
    resp = await p.chat(chat_body(user("hi"), routed_experts_prompt_start=2))
    assert resp.status == 200
    (record,) = p.calls()
    assert p.fake.requests[0]["routed_experts_prompt_start"] == 2
    assert record.extras["routed_experts_prompt_start"] == 2
    assert record.extras["routed_experts_incomplete"] is True
    assert _rows(record) == len(_full(record)) - 2


async def test_a_restarted_proxy_continues_the_stored_calls(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    fake = FakeVLLM(routed_experts=True)
    fake.push(*_turns(4))
    first = await start_proxy(tmp_path, fake=fake, sink=open_sink(url))
    try:
        messages = await _session(first, 2)
    finally:
        await stop_proxy(first)
    second = await start_proxy(tmp_path, fake=fake, sink=open_sink(url))
    try:
        messages = messages[:-1] if messages[-1]["role"] == "user" else messages
        await _session(second, 2, history=messages)
        records = second.calls()
    finally:
        await stop_proxy(second)
    assert len(records) == 4
    assert fake.requests[2]["routed_experts_prompt_start"] == len(_full(records[1]))
    assert records[2].extras["routed_experts_parent_call_id"] == records[1].call_id
    assert sum(_rows(r) for r in records) == len(_full(records[-1]))
    store = open_store(url)
    full = store.routed_experts(records[-1].call_id, include_open=True)
    assert full is not None
    assert read_experts(full)[1] == experts_for(_full(records[-1]))
