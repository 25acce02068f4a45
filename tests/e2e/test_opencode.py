"""Real OpenCode 1.18.33 through the proxy, in front of the scriptable fake vLLM (`-m e2e`).

OpenCode runs `opencode run "list the files" --file img.png` with the rollout's base URL from the
control API. The fake answers its title call (no tools) with a title, its first agent call with
reasoning and a `bash` tool call, and the next one with a final answer. What the proxy staged is
checked against what the fake produced, bit for bit.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus, StagedCallRecord
from capture_proxy.schemas.token_in_extras import plain_divergence_of
from capture_proxy.schemas.tokens import full_sequence
from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Fault, Turn
from capture_proxy.testing.fake_vllm._template import decode, encode
from scripts import opencode_env
from tests.support.proxy_harness import Proxy, start_proxy, stop_proxy

# opencode_binary: installs OpenCode (once per session) or fails the test saying why.
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("opencode_binary")]

TITLE = "Listing files"
REASONING = "I should list the files."
FINAL = "Here are the files."
OPENCODE_TIMEOUT_S = 180.0
# OpenCode's system prompt and 9 tool schemas are ~30 KB: ~30k ids with the fake's byte tokenizer.
FAKE_CONTEXT = 1 << 20


def script(*, title: Turn) -> Any:
    """The fake's answers: `title` for the title call, a bash call, then a final answer.

    A chat body is read by its messages; a token-in generate body (prompt ids only) by the
    fake's rendering of them: tools render as a ``<tools>`` block, results as ``<tool_response>``.
    """

    def answer(body: dict[str, Any]) -> Turn:
        if "messages" not in body:
            text = decode(body["token_ids"])
            tooled, answered = "<tools>" in text, "<tool_response>" in text
        else:
            tooled = bool(body.get("tools"))
            answered = any(m.get("role") == "tool" for m in body["messages"])
        if not tooled:
            return title
        if not answered:
            call = FakeToolCall("bash", {"command": "ls -la"})
            return Turn("", reasoning=REASONING, tool_calls=[call])
        return Turn(FINAL, reasoning="The listing is done.")

    return answer


def workdir(tmp_path: Path) -> tuple[Path, bytes]:
    work = tmp_path / "work"
    work.mkdir()
    png = opencode_env.tiny_png()
    (work / "img.png").write_bytes(png)
    (work / "notes.txt").write_text("hello\n")
    return work, png


async def run_opencode(
    base_url: str, work: Path, *, image: bool = True
) -> tuple[list[dict[str, Any]], str]:
    """`opencode run "list the files" --file img.png` (without `--file` unless `image`); its JSON
    events and stderr. Exit 0."""
    done = await asyncio.to_thread(
        opencode_env.opencode_run,
        base_url,
        "list the files",
        files=[work / "img.png"] if image else [],
        cwd=work,
        timeout=OPENCODE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return events, done.stderr


async def session(
    tmp_path: Path, control: Any, fake: FakeVLLM, rollout: str
) -> tuple[Proxy, list[dict[str, Any]], dict[str, Any], bytes]:
    """Run one OpenCode session through a proxy in front of `fake`; the proxy (still running),
    OpenCode's events, the sealed manifest and the image's bytes."""
    p = await start_proxy(tmp_path, fake=fake, admin_token=control.TOKEN)
    try:
        api = control(p.client)
        created = await api.create(rollout)
        assert created["base_url"].endswith(f"/r/{rollout}/v1")
        work, png = workdir(tmp_path)
        events, _ = await run_opencode(created["base_url"], work)
        manifest = await api.seal(rollout)
    except BaseException:
        await stop_proxy(p)
        raise
    return p, events, manifest, png


def steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenCode's finished agent steps: one per agent call (the title call is not a step)."""
    return [e for e in events if e["type"] == "step_finish"]


def assert_staged_as_produced(records: list[StagedCallRecord], fake: FakeVLLM) -> None:
    """Each record holds exactly what the fake generated for it: ids, float32 logprob bits."""
    produced = {r["id"]: r for r in fake.responses}
    assert sorted(r.extras["upstream_response_id"] for r in records) == sorted(produced)
    for record in records:
        made = produced[record.extras["upstream_response_id"]]
        assert record.prompt_token_ids.tolist() == made["prompt_token_ids"]
        assert record.completion_token_ids.tolist() == made["completion_token_ids"]
        assert record.completion_logprobs.tobytes() == array("f", made["logprobs"]).tobytes()
        finish = made["finish_reason"]
        if record.token_in and finish == "stop" and record.response.get("tool_calls"):
            # Generate knows no tool parser; the record keeps what the client saw (derender's).
            finish = "tool_calls"
        assert record.finish_reason == finish


def image_parts(messages: list[dict[str, Any]]) -> list[str]:
    """The URL of every image part in a conversation."""
    return [
        part["image_url"]["url"]
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image_url"
    ]


async def test_opencode_session_is_captured_exactly(tmp_path: Path, control: Any) -> None:
    fake = FakeVLLM(
        script=script(title=Turn(TITLE, reasoning="A title.")), max_model_len=FAKE_CONTEXT
    )
    p, events, manifest, png = await session(tmp_path, control, fake, "oc-image-tool")
    try:
        sha = hashlib.sha256(png).hexdigest()
        # OpenCode did what was scripted: ran the tool, printed the final answer.
        (tool,) = [e["part"] for e in events if e["type"] == "tool_use"]
        assert tool["tool"] == "bash"
        assert tool["state"]["input"] == {"command": "ls -la"}
        assert "img.png" in tool["state"]["output"]
        assert "".join(e["part"]["text"] for e in events if e["type"] == "text") == FINAL

        # Every call OpenCode made reached the upstream once and is in the manifest, in order,
        # staged with coordinates: the title call and one call per agent step.
        assert len(fake.requests) == 1 + len(steps(events)) == 3
        assert manifest["state"] == "sealed"
        assert manifest["poisoned"] is False
        calls = manifest["calls"]
        assert [c["seq"] for c in calls] == [0, 1, 2]
        assert [c["status"] for c in calls] == ["staged"] * 3

        with open_store(p.store_url) as store:
            records = store.fetch([c["coords"] for c in calls])  # verifies every digest
            assert [r.call_id for r in records] == [c["call_id"] for c in calls]
            assert [r.digest for r in records] == [c["coords"]["digest"] for c in calls]
            assert store.failures("oc-image-tool") == []
            traj = store.trajectory("oc-image-tool", include_open=True)
            store.verify()
        title, first, second = records
        assert_staged_as_produced(records, fake)

        # The title call (the first to arrive, no tools) is kept apart from the episode.
        assert "tools" not in title.request
        assert title.response["content"] == TITLE
        assert traj.apart == [title.call_id]
        assert traj.calls == [first.call_id, second.call_id]

        # OpenCode replays the reasoning as `reasoning`; the upstream saw only
        # `reasoning_content`, and so does the record.
        replayed = [
            m for body in fake.requests for m in body["messages"] if m["role"] == "assistant"
        ]
        assert replayed
        assert all("reasoning" not in m for m in replayed)
        (assistant,) = [m for m in second.request["messages"] if m["role"] == "assistant"]
        assert assistant["reasoning_content"] == REASONING
        assert "reasoning" not in assistant
        assert fake.requests[2]["messages"][-2]["reasoning_content"] == REASONING

        # The image: forwarded as its data URL, staged once per call as an attachment that the
        # record's request refers to by sha256.
        for body in fake.requests:
            (url,) = image_parts(body["messages"])
            assert base64.b64decode(url.removeprefix("data:image/png;base64,")) == png
        for record in records:
            (att,) = record.attachments
            assert (att.sha256, att.media_type, att.data) == (sha, "image/png", png)
            assert image_parts(record.request["messages"]) == [f"attachment:sha256:{sha}"]

        # OpenCode re-serialized the tool arguments compactly, so the call after the tool call
        # does not extend its parent's prompt + completion: the drift is reported where the two
        # part, and storage still shares the common prefix.
        assert fake.requests[2]["messages"][-2]["tool_calls"][0]["function"]["arguments"] == (
            '{"command":"ls -la"}'
        )
        parent = full_sequence(first.prompt_token_ids, first.completion_token_ids).tolist()
        (drift,) = traj.drift
        assert (drift.call_id, drift.parent_call_id) == (second.call_id, first.call_id)
        assert drift.parent_len == len(parent)
        assert decode(parent[: drift.position]).endswith('"arguments": {"command":')
        assert parent[drift.position] == encode(" ")[0]
        assert second.prompt_token_ids[drift.position] == encode('"')[0]
        assert second.parent_call_id == first.call_id
        assert calls[2]["coords"]["prev_len"] == drift.position < calls[1]["coords"]["cum_len"]
        assert [s.call_ids for s in traj.segments] == [(first.call_id,), (second.call_id,)]

        # OpenCode's key never reaches the upstream.
        for headers in fake.request_headers:
            assert opencode_env.API_KEY not in json.dumps(headers)
    finally:
        await stop_proxy(p)


async def test_opencode_hangs_up_on_a_slow_title_call_which_is_recorded_aborted(
    tmp_path: Path, control: Any
) -> None:
    # OpenCode does not wait for its title call: it exits when the agent loop ends. A title
    # answer slower than the whole session is cut off, and the manifest must say so.
    # Longer than OpenCode may live (it is killed at OPENCODE_TIMEOUT_S): never answered in time,
    # even on a loaded machine where the session itself is slow.
    slow_title = Turn(TITLE, fault=Fault.delay_first_byte(2 * OPENCODE_TIMEOUT_S))
    fake = FakeVLLM(script=script(title=slow_title), max_model_len=FAKE_CONTEXT)
    p, events, manifest, _ = await session(tmp_path, control, fake, "oc-slow-title")
    try:
        calls = manifest["calls"]
        assert len(fake.requests) == len(calls) == 1 + len(steps(events)) == 3
        assert manifest["poisoned"] is False
        title_call, *agent_calls = calls
        assert title_call["seq"] == 0
        assert title_call["status"] == "aborted"
        assert title_call["reason"]
        assert "coords" not in title_call
        assert [c["status"] for c in agent_calls] == ["staged", "staged"]
        # The fake notices the hang-up by polling: give it a moment (bounded).
        for _ in range(50):
            if fake.aborted:
                break
            await asyncio.sleep(0.1)
        assert fake.aborted == 1
        assert len(fake.responses) == 2  # the title was never generated

        with open_store(p.store_url) as store:
            (failure,) = store.failures("oc-slow-title")
            assert failure.call_id == title_call["call_id"]
            assert failure.status is CallStatus.ABORTED
            records = store.fetch([c["coords"] for c in agent_calls])
            traj = store.trajectory("oc-slow-title", include_open=True)
            store.verify()
        assert_staged_as_produced(records, fake)
        assert traj.apart == []
        assert traj.calls == [r.call_id for r in records]
    finally:
        await stop_proxy(p)


async def test_opencode_session_through_token_in_is_one_segment(
    tmp_path: Path, control: Any
) -> None:
    # Token-in on, a fake serving the scale-out routes with Qwen3's template (it drops earlier
    # reasoning), no image (images are not bridged). OpenCode re-serializes the tool arguments,
    # which drifts without token-in (test above); with it the agent's calls are one segment.
    fake = FakeVLLM(
        script=script(title=Turn(TITLE, reasoning="A title.")),
        max_model_len=FAKE_CONTEXT,
        scale_out=True,
        drop_past_reasoning=True,
    )
    p = await start_proxy(tmp_path, fake=fake, admin_token=control.TOKEN, token_in="on")
    rollout = "oc-token-in"
    try:
        api = control(p.client)
        created = await api.create(rollout)
        work, _ = workdir(tmp_path)
        events, _ = await run_opencode(created["base_url"], work, image=False)
        manifest = await api.seal(rollout)
        (tool,) = [e["part"] for e in events if e["type"] == "tool_use"]
        assert tool["state"]["input"] == {"command": "ls -la"}
        assert "".join(e["part"]["text"] for e in events if e["type"] == "text") == FINAL
        calls = manifest["calls"]
        assert [c["status"] for c in calls] == ["staged"] * 3
        with open_store(p.store_url) as store:
            records = store.fetch([c["coords"] for c in calls])
            traj = store.trajectory(rollout)
            store.verify()
        assert all(r.token_in for r in records)
        assert_staged_as_produced(records, fake)
        first, second = (r for r in records if r.request.get("tools"))
        parent = full_sequence(first.prompt_token_ids, first.completion_token_ids).tolist()
        assert second.prompt_token_ids.tolist()[: len(parent)] == parent
        # What token-in avoided: the plain rendering would have re-read the compact arguments.
        measured, position = plain_divergence_of(second.extras)
        assert measured
        assert position is not None
        assert decode(parent[:position]).endswith('"arguments": {"command":')
        assert traj.calls == [first.call_id, second.call_id]
        assert [s.call_ids for s in traj.segments] == [(first.call_id, second.call_id)]
        assert traj.drift == []
        assert traj.breaks == []
    finally:
        await stop_proxy(p)


def test_a_failed_install_fails_the_suites_with_the_reason(tmp_path: Path) -> None:
    # A cache that cannot be created: both installers fail. The suites must fail saying why;
    # a skip would let CI pass with the end-to-end tests silently missing.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "CAPTURE_PROXY_VLLM_URL"}
    env["CAPTURE_PROXY_CACHE"] = str(blocker / "cache")
    here = Path(__file__).resolve().parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{here / 'test_opencode.py'}::test_opencode_session_is_captured_exactly",
            f"{here / 'test_vllm.py'}::test_streamed_and_unary_calls_stage_the_same_ids",
        ],
        cwd=here.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert f"installing OpenCode {opencode_env.OPENCODE_VERSION} failed" in out
    assert "preparing vLLM 0.32.0 (scripts/tiny_vllm.py) failed" in out
    assert "Not a directory" in out
    assert "2 errors" in out
    assert "skipped" not in out
