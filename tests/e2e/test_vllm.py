"""The proxy in front of a real vLLM 0.32 (CPU, the tiny random model of scripts/tiny_vllm.py).

`-m vllm`. Each call through the proxy is followed (never overlapped: batching can flip the
near-tied greedy picks of a random model) by the same effective request sent straight to vLLM at
temperature 0: the staged prompt and completion ids must be vLLM's own. The model is text-only,
answers mostly in reasoning, and never makes a tool call on its own, so tool calls are written
into the history by the test; the token-in session below steers it into real ones instead.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from array import array
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.schemas.token_in_extras import plain_divergence_of, segment_break_of
from examples.rl_loop.agent import TOOLS  # the same bash tool the RL loop's agent offers
from scripts import opencode_env
from tests.support.proxy_harness import Proxy, sse_lines, start_proxy, stop_proxy
from tests.support.replay import read_answer, replayed

pytestmark = pytest.mark.vllm

SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools."}
USER = {"role": "user", "content": "List the files here."}
REASONING = "The user wants the files. I will run ls."
TOOL_CALL = {
    "id": "call_ls_1",
    "type": "function",
    "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
}
TOOL_CALL_TURN: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_ls_1", "content": "a.txt\nb.txt\nmain.py"}
MAX_TOKENS = 24


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "model": "policy",
        "messages": messages,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        **extra,
    }


def as_forwarded(client_body: dict[str, Any]) -> dict[str, Any]:
    """What the proxy sends vLLM for `client_body` (no policy set): replayed `reasoning` renamed
    `reasoning_content` in place, plus the token fields capture asks for."""
    forwarded = copy.deepcopy(client_body)
    for message in forwarded["messages"]:
        if "reasoning" in message:
            message["reasoning_content"] = message.pop("reasoning")
    forwarded.update(return_token_ids=True, logprobs=True)
    forwarded.setdefault("top_logprobs", 0)
    if forwarded.get("stream"):
        forwarded["stream_options"] = {"include_usage": True}
    return forwarded


async def direct(url: str, request: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """Send `request` straight to vLLM; its prompt ids, completion ids and logprobs."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{url}/v1/chat/completions", json=request) as resp,
    ):
        raw = await resp.read()
        assert resp.status == 200, raw[:2000]
    if not request.get("stream"):
        answer = json.loads(raw)
        choice = answer["choices"][0]
        logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
        return answer["prompt_token_ids"], choice["token_ids"], logprobs
    events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert raw.rstrip().endswith(b"data: [DONE]")
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    logprobs = [
        t["logprob"]
        for e in events
        for c in e["choices"]
        for t in (c.get("logprobs") or {}).get("content") or []
    ]
    return events[0]["prompt_token_ids"], ids, logprobs


async def assert_vllm_agrees(url: str, record: StagedCallRecord, sent: dict[str, Any]) -> None:
    """The record is the effective request `sent` to the proxy, and vLLM, asked again, gives the
    staged prompt and completion ids (greedy) with the same logprobs."""
    forwarded = as_forwarded(sent)
    capture_keys = ("return_token_ids", "logprobs", "top_logprobs", "stream_options")
    staged_request = {k: v for k, v in forwarded.items() if k not in capture_keys}
    for key in ("logprobs", "top_logprobs", "stream_options"):  # what the client itself asked
        if key in sent:
            staged_request[key] = sent[key]
    assert record.request == staged_request
    prompt, completion, logprobs = await direct(url, forwarded)
    assert record.prompt_token_ids.tolist() == prompt
    assert record.completion_token_ids.tolist() == completion
    assert len(completion) > 0
    # Same request, same single-sequence batch: identical here so far (0.0); a small tolerance
    # keeps a kernel-level rounding difference from failing what ids already prove.
    assert max(abs(a - b) for a, b in zip(record.completion_logprobs, logprobs, strict=True)) < 1e-3


async def stream_through(p: Proxy, rollout: str, request: dict[str, Any]) -> dict[str, Any]:
    """Stream `request` through the proxy; the reasoning and content it relayed, and its status."""
    resp = await p.chat(request, rollout=rollout)
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Capture-Status"] == "pending"
    reasoning, content, status = "", "", ""
    async for line in sse_lines(resp):
        if line.startswith(b": capture-status "):
            status = line.decode()
        elif line.startswith(b"data: {"):
            event = json.loads(line[6:])
            assert "prompt_token_ids" not in event  # not asked for: not relayed
            for choice in event["choices"]:
                assert "token_ids" not in choice
                reasoning += choice["delta"].get("reasoning") or ""
                content += choice["delta"].get("content") or ""
    call_id = resp.headers["X-Capture-Call-Id"]
    assert status == f": capture-status staged call_id={call_id}"
    return {"reasoning": reasoning, "content": content, "call_id": call_id}


async def test_multi_turn_through_the_proxy_stages_vllms_own_ids(
    vllm_url: str, tmp_path: Path, control: Any
) -> None:
    p = await start_proxy(tmp_path, upstream=vllm_url, admin_token=control.TOKEN)
    rollout = "vllm-multi-turn"
    try:
        # Turn 1, not streamed; the client asks for logprobs and gets exactly what was staged.
        first_body = body([SYSTEM, USER], logprobs=True)
        resp = await p.chat(first_body, rollout=rollout)
        first = await resp.json()
        assert resp.status == 200, first
        assert resp.headers["X-Capture-Status"] == "staged"
        assert "prompt_token_ids" not in first or first["prompt_token_ids"] is None
        (r1,) = p.calls(rollout)
        relayed = [t["logprob"] for t in first["choices"][0]["logprobs"]["content"]]
        assert array("f", relayed).tobytes() == r1.completion_logprobs.tobytes()
        await assert_vllm_agrees(vllm_url, r1, first_body)

        # Turn 2, streamed: the agent replays its tool call with `reasoning` (after the last user
        # message, where the template keeps it) and the tool's result.
        history = [SYSTEM, USER, {**TOOL_CALL_TURN, "reasoning": REASONING}, TOOL_RESULT]
        second_body = body(history, stream=True)
        second = await stream_through(p, rollout, second_body)
        r2 = p.calls(rollout)[1]
        assert r2.call_id == second["call_id"]
        assert r2.request["messages"][2]["reasoning_content"] == REASONING
        assert "reasoning" not in r2.request["messages"][2]
        assert (r2.response.get("reasoning_content") or "") == second["reasoning"]
        await assert_vllm_agrees(vllm_url, r2, second_body)

        # The replayed reasoning reached the prompt: without it vLLM renders fewer ids.
        bare = copy.deepcopy(history)
        del bare[2]["reasoning"]
        without, _, _ = await direct(vllm_url, as_forwarded(body(bare, max_tokens=1)))
        assert without != r2.prompt_token_ids.tolist()
        assert len(without) < len(r2.prompt_token_ids)

        # Turn 3, not streamed: the answer replayed as the agent would, then a new user message
        # (the template now drops the earlier reasoning: a new user turn ends that tool loop).
        answer = {"role": "assistant", "content": second["content"]}
        if second["reasoning"]:
            answer["reasoning"] = second["reasoning"]
        third_body = body([*history, answer, {"role": "user", "content": "How many files?"}])
        resp = await p.chat(third_body, rollout=rollout)
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Capture-Status"] == "staged"
        r3 = p.calls(rollout)[2]
        await assert_vllm_agrees(vllm_url, r3, third_body)

        manifest = await control(p.client).seal(rollout)
        assert [c["status"] for c in manifest["calls"]] == ["staged"] * 3
        assert [c["call_id"] for c in manifest["calls"]] == [r1.call_id, r2.call_id, r3.call_id]
        with open_store(p.store_url) as store:
            fetched = store.fetch([c["coords"] for c in manifest["calls"]])
            assert [r.prompt_token_ids for r in fetched] == [
                r.prompt_token_ids for r in (r1, r2, r3)
            ]
            assert store.failures(rollout) == []
            traj = store.trajectory(rollout, include_open=True)
            store.verify()
        generated = sum(len(r.completion_token_ids) for r in (r1, r2, r3))
        assert sum(traj.loss_mask) == generated
        assert r1.upstream_version == "0.32.0"
        assert r1.tokenizer_fingerprint
        # Dev mode: each call's engine weight version read for it from vLLM's /weight_info.
        assert [r.engine_weight_version for r in (r1, r2, r3)] == ["default"] * 3
    finally:
        await stop_proxy(p)


async def test_streamed_and_unary_calls_stage_the_same_ids(vllm_url: str, tmp_path: Path) -> None:
    p = await start_proxy(tmp_path, upstream=vllm_url)
    try:
        history = [SYSTEM, USER, {**TOOL_CALL_TURN, "reasoning": REASONING}, TOOL_RESULT]
        unary = body(history)
        resp = await p.chat(unary, rollout="vllm-both")
        assert resp.headers["X-Capture-Status"] == "staged"
        await resp.read()
        await stream_through(p, "vllm-both", body(history, stream=True))
        r1, r2 = p.calls("vllm-both")
        assert r1.prompt_token_ids == r2.prompt_token_ids
        assert r1.completion_token_ids == r2.completion_token_ids
        assert r1.completion_logprobs.tobytes() == r2.completion_logprobs.tobytes()
        # Not a retry: the stream flag makes it another request.
        assert r2.retry_of is None
    finally:
        await stop_proxy(p)


async def test_staged_request_resent_renders_the_staged_prompt(
    vllm_url: str, tmp_path: Path
) -> None:
    p = await start_proxy(tmp_path, upstream=vllm_url)
    try:
        resp = await p.chat(body([SYSTEM, USER]), rollout="vllm-resend")
        assert resp.status == 200
        await resp.read()
        (record,) = p.calls("vllm-resend")
        prompt, _, _ = await direct(vllm_url, as_forwarded(dict(record.request)))
        assert prompt == record.prompt_token_ids.tolist()
    finally:
        await stop_proxy(p)


async def test_opencode_against_real_vllm_every_call_accounted_for(
    vllm_url: str, tmp_path: Path, control: Any, opencode_binary: Path
) -> None:
    # Steered to finish (docs/reports/e2e.md): a regex answer with thinking off ends the agent
    # loop after one call; text only, as the tiny model cannot take images.
    p = await start_proxy(tmp_path, upstream=vllm_url, admin_token=control.TOKEN)
    rollout = "vllm-opencode"
    try:
        api = control(p.client)
        created = await api.create(rollout)
        work = tmp_path / "work"
        work.mkdir()
        steer = {
            "structured_outputs": {"regex": "Done\\."},
            "chat_template_kwargs": {"enable_thinking": False},
        }
        done = await asyncio.to_thread(
            opencode_env.opencode_run,
            created["base_url"],
            "list the files",
            cwd=work,
            timeout=300,
            image_input=False,
            model_options=steer,
        )
        manifest = await api.seal(rollout)
        calls = manifest["calls"]
        assert done.returncode == 0, (done.stderr[-3000:], calls)
        events = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        assert "".join(e["part"]["text"] for e in events if e["type"] == "text") == "Done."
        agent_steps = [e for e in events if e["type"] == "step_finish"]
        # The title call and one call per agent step, each staged or on the ledger with a reason.
        assert len(calls) >= 1 + len(agent_steps)
        assert [c["seq"] for c in calls] == list(range(len(calls)))
        with open_store(p.store_url) as store:
            failures = {f.call_id: f for f in store.failures(rollout)}
            staged = [c for c in calls if c["status"] == "staged"]
            records = store.fetch([c["coords"] for c in staged])
            store.verify()
        for call in calls:
            if call["status"] != "staged":
                assert failures[call["call_id"]].status == call["status"], call
                assert call["reason"], call
        assert len(failures) == len(calls) - len(staged)
        agent = [r for r in records if r.request.get("tools")]
        assert len(agent) == len(agent_steps) >= 1
        for record in agent:
            # OpenCode's system prompt and tool schemas: ~16k ids with the 4k tokenizer.
            assert len(record.prompt_token_ids) > 10_000
            assert record.response["content"] == "Done."
            assert record.request["structured_outputs"] == steer["structured_outputs"]
    finally:
        await stop_proxy(p)


# A session replayed for token-in: thinking on (the template's default), the same tools and
# template keys on every call. The random model only reasons and never closes its reasoning on
# its own, and vLLM applies `structured_outputs` only once reasoning has ended, so a tool-call
# turn is steered by logit biases (ids of the tiny tokenizer): `</think>` wins the first token,
# then the regex of a hermes block is sampled, and `<|im_end|>` beats `<|endoftext|>` at its end.
# A free turn is reasoning cut by `length` (no end of turn).
THINK_END, IM_END = "4", "2"


def steer_tool_call(command: str) -> dict[str, Any]:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    literal = re.sub(r"([.{}()\[\]*+?|^$\\])", r"\\\1", call)
    regex = f"<tool_call>\n{literal}\n</tool_call>"
    return {
        "logit_bias": {THINK_END: 100, IM_END: 50},
        "structured_outputs": {"regex": regex},
        "max_tokens": 64,
    }


#: (streamed, steering) per call: a tool call, free reasoning, a streamed tool call, reasoning.
SESSION: list[tuple[bool, dict[str, Any]]] = [
    (False, steer_tool_call("ls -la")),
    (True, {"max_tokens": 8}),
    (True, steer_tool_call("wc -l a.txt")),
    (False, {"max_tokens": 8}),
]


async def play_session(p: Proxy, rollout: str) -> list[StagedCallRecord]:
    """Play `SESSION` through the proxy as OpenCode would: each answer replayed (reasoning as
    `reasoning`, tool arguments re-serialized), then a tool result after a tool call, else a new
    user message. Every call must be staged; the staged records, in order."""
    messages: list[dict[str, Any]] = [SYSTEM, USER]
    for turn, (stream, steer) in enumerate(SESSION):
        request = {**body(messages), "stream": stream, **steer}
        answer = await read_answer(await p.chat(request, rollout=rollout), stream=stream)
        assert answer.status == "staged", (turn, answer)
        # Steered as intended: a tool call on the steered turns, reasoning only on the others.
        assert bool(answer.tool_calls) == ("structured_outputs" in steer), (turn, answer)
        assert answer.tool_calls or answer.reasoning, (turn, answer)
        follow: list[dict[str, Any]] = [
            {"role": "tool", "tool_call_id": call["id"], "content": f"result {turn}"}
            for call in answer.tool_calls
        ] or [{"role": "user", "content": f"Go on ({turn})."}]
        messages = [*messages, replayed(answer), *follow]
    records = p.calls(rollout)
    assert len(records) == len(SESSION)
    return records


async def test_token_in_session_is_one_segment_of_the_models_own_tokens(
    vllm_url: str, tmp_path: Path, control: Any
) -> None:
    p = await start_proxy(tmp_path, upstream=vllm_url, admin_token=control.TOKEN, token_in="on")
    rollout = "vllm-token-in"
    try:
        records = await play_session(p, rollout)
        assert all(r.token_in for r in records)
        # Each call's prompt is the previous call's prompt + completion, exactly, then the bridge.
        for prev, r in pairwise(records):
            exact = prev.prompt_token_ids.tolist() + prev.completion_token_ids.tolist()
            assert r.prompt_token_ids.tolist()[: len(exact)] == exact
            assert segment_break_of(r.extras) is None
            # Qwen3's rendering drops the reasoning and re-reads the re-serialized arguments:
            # the plain prompt would have differed inside the previous call's tokens.
            measured, position = plain_divergence_of(r.extras)
            assert measured, r.extras
            assert position is not None
            assert position < len(exact)
        # The bridge: after a tool call ended on <|im_end|> only what follows it; after
        # reasoning cut by `length` the whole end of turn, inserted by the proxy.
        assert records[1].finish_reason == "length"
        assert [r.completion_token_ids[-1] for r in records[::2]] == [int(IM_END)] * 2
        assert [[s[2] for s in r.bridge_spans] for r in records] == [
            [],
            ["turn_close"],
            ["end_of_turn_added"],
            ["turn_close"],
        ]
        manifest = await control(p.client).seal(rollout)
        assert [c["status"] for c in manifest["calls"]] == ["staged"] * len(SESSION)
        with open_store(p.store_url) as store:
            traj = store.trajectory(rollout)
            store.verify()
        assert traj.calls == [r.call_id for r in records]
        assert traj.drift == []
        assert traj.breaks == []
        assert len(traj.segments) == 1
        last = records[-1]
        assert traj.token_ids.tolist() == (
            last.prompt_token_ids.tolist() + last.completion_token_ids.tolist()
        )
        assert sum(traj.loss_mask) == sum(len(r.completion_token_ids) for r in records)
    finally:
        await stop_proxy(p)


async def test_the_same_session_without_token_in_drifts(
    vllm_url: str, tmp_path: Path, control: Any
) -> None:
    p = await start_proxy(tmp_path, upstream=vllm_url, admin_token=control.TOKEN)
    rollout = "vllm-plain"
    try:
        records = await play_session(p, rollout)
        assert not any(r.token_in for r in records)
        await control(p.client).seal(rollout)
        with open_store(p.store_url) as store:
            traj = store.trajectory(rollout)
        # Every replayed turn re-rendered differs from what the model sampled.
        assert [d.call_id for d in traj.drift] == [r.call_id for r in records[1:]]
        assert [b.reason for b in traj.breaks] == ["drift"] * 3
        assert len(traj.segments) == len(SESSION)
    finally:
        await stop_proxy(p)
