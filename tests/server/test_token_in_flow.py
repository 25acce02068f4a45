"""Token-in calls through the real proxy, against the fake vLLM's render, generate and derender
routes with a Qwen3-style template that drops earlier reasoning (not append-only)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import orjson
import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.schemas.token_in_extras import plain_divergence_of, segment_break_of
from capture_proxy.sinks.registry import open_sink
from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
from capture_proxy.testing.fake_vllm._template import IM_END
from tests.inspect.test_inspect import inspect
from tests.support.proxy_harness import Proxy, chat_body, sse_lines, user
from tests.support.token_in import labelled_counts

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} tool",
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}},
        },
    }
    for name, arg in (("bash", "command"), ("read", "path"))
]
SYSTEM = {"role": "system", "content": "You are a coding agent."}
READER = "reader-token-for-reads-4567"
ADMIN = "admin-token-for-writes-0123"


def fake() -> FakeVLLM:
    return FakeVLLM(scale_out=True, drop_past_reasoning=True)


def session_turns() -> list[Turn]:
    """What the model answers over the 4-turn session, in order."""
    return [
        Turn(
            reasoning="I should look around.", tool_calls=[FakeToolCall("bash", {"command": "ls"})]
        ),
        Turn(content="There are two files.", reasoning="The listing shows a.py and b.py."),
        Turn(reasoning="Read it.", tool_calls=[FakeToolCall("read", {"path": "a.py"})]),
        Turn(content="a.py prints hello.", reasoning="It is one line."),
    ]


async def ask(
    p: Proxy, messages: list[dict[str, Any]], *, stream: bool, rollout: str = "r1"
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """One call as OpenCode makes it: the capture status, the assistant message as OpenCode
    replays it (`reasoning`, tool arguments re-serialized compactly), and the answer (unary) or
    the last chunk (streamed)."""
    body = chat_body(*messages, tools=TOOLS, stream=stream)
    resp = await p.chat(body, rollout=rollout)
    assert resp.status == 200, await resp.text()
    if not stream:
        answer = await resp.json()
        message = answer["choices"][0]["message"]
        status = resp.headers["X-Capture-Status"]
        content, reasoning = message.get("content"), message.get("reasoning")
        calls = message.get("tool_calls") or []
    else:
        content, reasoning, status, answer = "", "", "", {}
        calls = []
        async for line in sse_lines(resp):
            if line.startswith(b": capture-status "):
                status = line.split()[2].decode()
            if not line.startswith(b"data: {"):
                continue
            answer = orjson.loads(line[6:])
            assert "error" not in answer, answer
            for choice in answer["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                reasoning += delta.get("reasoning") or ""
                for tc in delta.get("tool_calls") or ():
                    if tc.get("id"):
                        calls.append(
                            {
                                "id": tc["id"],
                                "type": "function",
                                "function": {"name": tc["function"]["name"], "arguments": ""},
                            }
                        )
                    calls[tc["index"]]["function"]["arguments"] += (
                        tc["function"].get("arguments") or ""
                    )
    replayed: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if reasoning:
        replayed["reasoning"] = reasoning
    if calls:
        replayed["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    # OpenCode parses the arguments and serializes them again, compactly.
                    "arguments": orjson.dumps(orjson.loads(c["function"]["arguments"])).decode(),
                },
            }
            for c in calls
        ]
    return status, replayed, answer


def tool_result(call: dict[str, Any], text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call["id"], "content": text}


async def run_session(p: Proxy, rollout: str = "r1") -> list[StagedCallRecord]:
    """The 4-turn session, streamed and not in turn, each answer replayed as OpenCode does."""
    p.fake.push(*session_turns())
    messages: list[dict[str, Any]] = [SYSTEM, user("What is in this folder?")]
    status, replayed, _ = await ask(p, messages, stream=True, rollout=rollout)
    assert status == "staged"
    messages += [replayed, tool_result(replayed["tool_calls"][0], "a.py\nb.py")]
    status, replayed, _ = await ask(p, messages, stream=False, rollout=rollout)
    assert status == "staged"
    messages += [replayed, user("What does a.py do?")]
    status, replayed, _ = await ask(p, messages, stream=True, rollout=rollout)
    assert status == "staged"
    messages += [replayed, tool_result(replayed["tool_calls"][0], "print('hello')")]
    status, replayed, _ = await ask(p, messages, stream=False, rollout=rollout)
    assert status == "staged"
    return p.calls(rollout)


def assert_extends(records: list[StagedCallRecord]) -> None:
    for before, after in itertools.pairwise(records):
        sent = list(before.prompt_token_ids) + list(before.completion_token_ids)
        assert list(after.prompt_token_ids[: len(sent)]) == sent


async def test_a_replayed_session_is_one_segment_with_token_in(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    records = await run_session(p)
    assert len(records) == 4
    assert all(r.token_in for r in records)
    assert [r.finish_reason for r in records] == ["tool_calls", "stop", "tool_calls", "stop"]
    assert_extends(records)
    # What generate was sent is what was recorded.
    generated = [r for r in p.fake.responses]
    assert [g["prompt_token_ids"] for g in generated] == [list(r.prompt_token_ids) for r in records]
    breaks = [segment_break_of(r.extras) for r in records]
    assert [b.reason if b else None for b in breaks] == ["no_prior", None, None, None]
    # The plain rendering drops the earlier reasoning: token-in avoided that drift.
    measured = [plain_divergence_of(r.extras) for r in records]
    assert measured[0] == (True, None)
    assert all(m[0] and m[1] is not None for m in measured[1:])
    # Call 1 replays call 0's tool call with its arguments re-serialized: the plain rendering
    # diverges inside call 0's completion, which token-in sends as sampled.
    start = len(records[0].prompt_token_ids)
    assert start < measured[1][1] < start + len(records[0].completion_token_ids)  # type: ignore[operator]
    store = open_store(p.store_url)
    store.verify()  # every digest holds, token-in fields included
    traj = store.trajectory("r1", include_open=True)
    assert len(traj.segments) == 1
    assert traj.drift == []
    assert traj.calls == [r.call_id for r in records]
    assert all(r.bridge_spans for r in records[1:])
    assert traj.bridge_spans
    assert all(traj.loss_mask[s] == 0 for s, _, _ in traj.bridge_spans)
    # What token-in avoided is counted once per call, and shown by inspect.
    text = await (await p.client.get("/metrics")).text()
    assert 'capture_proxy_token_in_calls_total{reason="no_prior",result="new_segment"} 1.0' in text
    assert 'capture_proxy_token_in_calls_total{reason="",result="extended"} 3.0' in text
    assert "capture_proxy_token_in_plain_divergence_total 3.0" in text
    # Calls 1 and 2 are the first of their shapes (a tool result after a tool call, a user
    # message after an answer): the dummy renders place their appended tokens. Call 3 has call
    # 1's shape; the rendering re-serializes its tool call, and the end of sequence the model
    # stopped on places them (docs/token-in.md, "A steady call without dummy renders").
    placed = await labelled_counts(p, "capture_proxy_token_in_placed_total")
    assert placed == {"dummies": 2.0, "rendering": 1.0}
    code, shown = inspect(p.store_url, "--rollout", "r1")
    assert code == 0
    assert "4 token-in call(s); plain rendering would have diverged in 3 of 4" in shown


async def test_the_same_session_without_token_in_drifts(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake())
    records = await run_session(p)
    assert not any(r.token_in for r in records)
    traj = open_store(p.store_url).trajectory("r1", include_open=True)
    assert traj.drift
    assert len(traj.segments) > 1


# -- the hard cases, once each through the proxy ---------------------------------------------


async def _call(p: Proxy, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    resp = await p.chat(chat_body(*messages, tools=TOOLS, **extra))
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Capture-Status"] == "staged"
    return dict(await resp.json())


def _replay(answer: dict[str, Any]) -> dict[str, Any]:
    message = answer["choices"][0]["message"]
    replayed = {"role": "assistant", "content": message["content"] or ""}
    if message.get("reasoning"):
        replayed["reasoning"] = message["reasoning"]
    if message.get("tool_calls"):
        replayed["tool_calls"] = message["tool_calls"]
    return replayed


async def test_a_completion_cut_by_length_gets_the_end_of_turn_added(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    p.fake.push(Turn(content="A long answer that goes on.", reasoning="Think."), Turn("ok"))
    messages = [SYSTEM, user("Talk.")]
    first = await _call(p, messages, max_tokens=12)
    assert first["choices"][0]["finish_reason"] == "length"
    await _call(p, [*messages, _replay(first), user("Go on.")])
    before, after = p.calls()
    assert before.finish_reason == "length"
    assert before.completion_token_ids[-1] != IM_END  # no end-of-turn token was sampled
    assert_extends([before, after])
    start = len(before.prompt_token_ids) + len(before.completion_token_ids)
    [(s, _, reason)] = after.bridge_spans
    assert (s, reason) == (start, "end_of_turn_added")
    assert after.prompt_token_ids[s] == IM_END
    assert segment_break_of(after.extras) is None


async def test_a_completion_that_stopped_gets_only_what_follows_its_end_of_turn(
    make_proxy: Any,
) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    p.fake.push(Turn(content="Short.", reasoning="Think."), Turn("ok"))
    messages = [SYSTEM, user("Talk.")]
    first = await _call(p, messages)
    await _call(p, [*messages, _replay(first), user("Go on.")])
    before, after = p.calls()
    assert before.completion_token_ids[-1] == IM_END
    start = len(before.prompt_token_ids) + len(before.completion_token_ids)
    assert [(s, r) for s, _, r in after.bridge_spans] == [(start, "turn_close")]


async def test_several_tool_results_appended_at_once_extend_the_call(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    calls = [FakeToolCall("read", {"path": "a.py"}), FakeToolCall("read", {"path": "b.py"})]
    p.fake.push(Turn(reasoning="Both.", tool_calls=calls), Turn("Both print hello."))
    messages = [SYSTEM, user("Read a.py and b.py.")]
    first = await _call(p, messages)
    replayed = _replay(first)
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    results = [tool_result(c, "print('hello')") for c in replayed["tool_calls"]]
    await _call(p, [*messages, replayed, *results])
    records = p.calls()
    assert_extends(records)
    assert segment_break_of(records[1].extras) is None


async def test_an_edited_history_starts_a_new_segment_with_its_reason(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    p.fake.push(Turn("First."), Turn("Second."), Turn("Third."))
    messages = [SYSTEM, user("One.")]
    first = await _call(p, messages)
    messages += [_replay(first), user("Two.")]
    second = await _call(p, messages)
    # The agent compacts its context: the first exchange is summarized away.
    await _call(p, [SYSTEM, user("Summary: we talked."), _replay(second), user("Three.")])
    records = p.calls()
    cut = segment_break_of(records[2].extras)
    assert cut is not None
    assert cut.reason == "history_edited"
    assert "message 1" in cut.detail
    # The plain rendering was sent: what the fake's template gives the request.
    assert p.fake.responses[2]["prompt_token_ids"] == list(records[2].prompt_token_ids)
    assert records[2].bridge_spans == ()
    traj = open_store(p.store_url).trajectory("r1", include_open=True)
    assert len(traj.segments) == 2
    assert [b.reason for b in traj.breaks] == ["history_edited"]
    assert traj.drift == []


async def test_the_answers_are_ordinary_chat_completions(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    p.fake.push(Turn(reasoning="Hm.", tool_calls=[FakeToolCall("bash", {"command": "ls"})]))
    answer = await _call(p, [SYSTEM, user("List.")])
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["logprobs"] is None  # the client did not ask
    assert "token_ids" not in choice
    assert "prompt_token_ids" not in answer
    [record] = p.calls()
    assert record.finish_reason == "tool_calls"  # as the client saw it (generate says "stop")
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(record.prompt_token_ids)
    assert usage["completion_tokens"] == len(record.completion_token_ids)
    assert choice["message"]["reasoning"] == "Hm."
    assert orjson.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "command": "ls"
    }


async def test_a_title_call_between_two_calls_does_not_break_the_line(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    p.fake.push(Turn("First."), Turn("A title"), Turn("Second."))
    messages = [SYSTEM, user("One.")]
    first = await _call(p, messages)
    # OpenCode's title call: its own system prompt, no tools, in the same rollout.
    title = [{"role": "system", "content": "Write a title."}, user("One.")]
    resp = await p.chat(chat_body(*title))
    assert resp.headers["X-Capture-Status"] == "staged"
    await _call(p, [*messages, _replay(first), user("Two.")])
    main, side, after = p.calls()
    assert segment_break_of(after.extras) is None
    assert_extends([main, after])
    traj = open_store(p.store_url).trajectory("r1", include_open=True)
    assert traj.apart == [side.call_id]
    assert len(traj.segments) == 1


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_token_in_records_verify_in_each_store_and_read_remotely(
    make_proxy: Any, tmp_path: Path, kind: str
) -> None:
    store = f"sqlite:///{tmp_path / 's.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/pq"
    p = await make_proxy(
        fake=fake(), token_in="on", sink=open_sink(store), admin_token=ADMIN, reader_token=READER
    )
    p.store_url = store  # where the test reads it back
    await run_session(p)
    url = str(p.client.make_url("")).rstrip("/")

    def read() -> None:
        with open_store(store) as local, open_store(url, token=READER) as remote:
            local.verify()
            here = local.calls("r1", include_open=True)
            there = remote.calls("r1", include_open=True)
            assert [r.digest for r in there] == [r.digest for r in here]
            assert [r.bridge_spans for r in there] == [r.bridge_spans for r in here]
            assert all(r.token_in for r in there)
            assert len(remote.trajectory("r1", include_open=True).segments) == 1

    await asyncio.to_thread(read)
