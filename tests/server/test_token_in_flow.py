"""Token-in calls through the real proxy, against the fake vLLM's render, generate and derender
routes with a Qwen3-style template that drops earlier reasoning (not append-only)."""

from __future__ import annotations

import itertools
from typing import Any

import orjson

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.schemas.token_in_extras import plain_divergence_of, segment_break_of
from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
from tests.support.proxy_harness import Proxy, chat_body, sse_lines, user

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
    assert_extends(records)
    # What generate was sent is what was recorded.
    generated = [r for r in p.fake.responses]
    assert [g["prompt_token_ids"] for g in generated] == [list(r.prompt_token_ids) for r in records]
    breaks = [segment_break_of(r.extras) for r in records]
    assert [b.reason if b else None for b in breaks] == ["no_prior", None, None, None]
    # The plain rendering drops the earlier reasoning: token-in avoided that drift.
    measured = [plain_divergence_of(r.extras) for r in records]
    assert measured[0] == (True, None)
    assert all(m[0] and m[1] is not None for m in measured[2:])
    traj = open_store(p.store_url).trajectory("r1", include_open=True)
    assert len(traj.segments) == 1
    assert traj.drift == []
    assert traj.calls == [r.call_id for r in records]
    assert all(r.bridge_spans for r in records[1:])


async def test_the_same_session_without_token_in_drifts(make_proxy: Any) -> None:
    p = await make_proxy(fake=fake())
    records = await run_session(p)
    assert not any(r.token_in for r in records)
    traj = open_store(p.store_url).trajectory("r1", include_open=True)
    assert traj.drift
    assert len(traj.segments) > 1
