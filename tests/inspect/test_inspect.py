"""`capture-proxy inspect` on real stores made by the real proxy in front of the fake vLLM.

The story store (`_story`) holds the rollouts a person debugs: one cut short by a 422, one
poisoned by a call whose token ids went missing, one whose replayed tool arguments drifted, one
with an image, and one with a retry. Tests run the command in-process (`main(argv, stdout=...)`)
and as real subprocesses (errors, --verify, --follow, a real terminal).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import fcntl
import hashlib
import io
import json
import os
import pty
import re
import sqlite3
import struct
import subprocess
import sys
import termios
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
from rich.console import Console

from capture_proxy.inspect.cli import PlainOut, RichOut, main
from capture_proxy.inspect.follow import Follower
from capture_proxy.inspect.render import Column, render_call, render_rollout
from capture_proxy.inspect.shapes import StagedEntry
from capture_proxy.inspect.views import call_view, rollout_view
from capture_proxy.read.reader import Store, open_store
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import (
    CallStatus,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.sinks.sqlite import SQLiteSink
from capture_proxy.testing.fake_vllm import FakeToolCall, Fault, Turn
from tests.support import ROOT
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user
from tests.support.sink_factories import Session, image

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # 1032 bytes
#: The command as people run it (`python -m capture_proxy` is the `capture-proxy` script).
RUN = [sys.executable, "-m", "capture_proxy", "inspect"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def inspect(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    code = main(list(argv), stdout=buf)
    return code, buf.getvalue()


def inspect_json(*argv: str) -> Any:
    code, text = inspect(*argv, "--json")
    assert code == 0, text
    return orjson.loads(text)


def run(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RUN, *argv], capture_output=True, text=True, timeout=timeout)


async def _chat(p: Proxy, body: dict[str, Any], rollout: str, want: str) -> str:
    resp = await p.chat(body, rollout=rollout)
    assert resp.headers["X-Capture-Status"] == want, await resp.text()
    return resp.headers["X-Capture-Call-Id"]


async def _story(p: Proxy) -> dict[str, str]:
    """Stage the rollouts the tests look at; return the interesting call ids."""
    ids: dict[str, str] = {}
    ids["stop_ok"] = await _chat(
        p, chat_body(user("look at [bold]this[/bold]")), "r-stop", "staged"
    )
    bad = chat_body(user("a"), {"role": "assistant", "content": "b", "thinking_trace": "t"})
    ids["stop_422"] = await _chat(p, bad, "r-stop", "rejected")

    ids["poison_ok"] = await _chat(p, chat_body(user("first")), "r-poison", "staged")
    p.fake.push(Turn("hello", fault=Fault.drop_token_ids()))
    ids["poison_bad"] = await _chat(p, chat_body(user("second")), "r-poison", "capture_failed")

    # OpenCode re-serializes tool arguments compactly when it replays them: the replayed turn
    # renders other tokens than the model generated, so the next call drifts.
    p.fake.push(
        Turn("", reasoning="I should look.", tool_calls=[FakeToolCall("bash", {"command": "ls"})])
    )
    first = chat_body(user("list files"), tools=TOOLS, tool_choice="auto")
    resp = await p.chat(first, rollout="r-drift")
    ids["drift_0"] = resp.headers["X-Capture-Call-Id"]
    message = (await resp.json())["choices"][0]["message"]
    (tc,) = message["tool_calls"]
    compact = orjson.dumps(json.loads(tc["function"]["arguments"])).decode()
    assert compact != tc["function"]["arguments"]
    replay = chat_body(
        user("list files"),
        {
            "role": "assistant",
            "content": "",
            "reasoning": message["reasoning"],
            "tool_calls": [{**tc, "function": {"name": "bash", "arguments": compact}}],
        },
        {"role": "tool", "tool_call_id": tc["id"], "content": "a.txt\nb.txt"},
        tools=TOOLS,
        tool_choice="auto",
    )
    ids["drift_1"] = await _chat(p, replay, "r-drift", "staged")

    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    content = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    ids["image"] = await _chat(
        p, chat_body({"role": "user", "content": content}), "r-image", "staged"
    )

    for key in ("retry_0", "retry_1"):
        ids[key] = await _chat(p, chat_body(user("same question")), "r-retry", "staged")
    return ids


@dataclass
class Story:
    """The story store, built once per module (tests that damage a store take a `copy`)."""

    store_url: str
    ids: dict[str, str]

    @property
    def path(self) -> str:
        return self.store_url.removeprefix("sqlite:///")

    def calls(self, rollout: str) -> list[StagedCallRecord]:
        with open_store(self.store_url) as store:
            return store.calls(rollout, include_open=True, include_poisoned=True)

    def copy(self, tmp_path: Path) -> Story:
        target = tmp_path / "copy.db"
        src, dst = sqlite3.connect(self.path), sqlite3.connect(target)
        try:
            src.backup(dst)  # a consistent copy, WAL included
        finally:
            src.close()
            dst.close()
        return Story(f"sqlite:///{target}", dict(self.ids))


async def _build_story(folder: Path) -> Story:
    p = await start_proxy(folder)
    try:
        ids = await _story(p)
    finally:
        await stop_proxy(p)  # closes the sink: everything is on disk
    return Story(p.store_url, ids)


@pytest.fixture(scope="module")
def story_store(tmp_path_factory: pytest.TempPathFactory) -> Story:
    folder = tmp_path_factory.mktemp("story")
    # Its own event loop, on a thread: the module fixture must not share a test's loop.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _build_story(folder)).result(timeout=60)


@pytest.fixture
def story(story_store: Story) -> tuple[Story, dict[str, str]]:
    return story_store, story_store.ids


def _delta_tokens(store_url: str, call_id: str) -> bytes:
    path = store_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        (data,) = db.execute(
            "SELECT delta_tokens FROM calls WHERE call_id=?", (call_id,)
        ).fetchone()
    db.close()
    return bytes(data)


def _flip_first_token_byte(store_url: str, call_id: str) -> None:
    path = store_url.removeprefix("sqlite:///")
    data = _delta_tokens(store_url, call_id)
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE calls SET delta_tokens=? WHERE call_id=?",
            (bytes([data[0] ^ 0x01]) + data[1:], call_id),
        )
    db.close()


# -- store overview ---------------------------------------------------------------------------


async def test_overview_lists_rollouts_newest_first(story: Any) -> None:
    p, _ = story
    code, text = inspect(p.store_url)
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith(f"5 rollout(s) in {p.store_url}")
    header = lines[1].split()
    assert header[:4] == ["ROLLOUT", "STATE", "POISONED", "CALLS"]
    order = [line.split()[0] for line in lines[2:7]]
    assert order == ["r-retry", "r-image", "r-drift", "r-poison", "r-stop"]
    rows = {line.split()[0]: line for line in lines[2:7]}
    assert "POISONED" in rows["r-poison"]
    assert "1 capture_failed" in rows["r-poison"]
    assert "1 rejected" in rows["r-stop"]
    assert "POISONED" not in rows["r-stop"]
    assert lines[-1].startswith("POISONED: r-poison")

    doc = inspect_json(p.store_url)
    assert doc["view"] == "rollouts"
    by_id = {r["rollout_id"]: r for r in doc["rollouts"]}
    assert [r["rollout_id"] for r in doc["rollouts"]] == order
    stop = by_id["r-stop"]
    assert (stop["state"], stop["poisoned"], stop["calls"]) == ("open", False, 2)
    assert stop["statuses"] == {"staged": 1, "rejected": 1}
    (record,) = p.calls("r-stop")
    assert stop["prompt_tokens"] == len(record.prompt_token_ids)
    assert stop["completion_tokens"] == len(record.completion_token_ids)
    assert stop["first_at_ms"] <= stop["last_at_ms"]
    assert by_id["r-poison"]["poisoned"] is True


# -- one rollout ------------------------------------------------------------------------------


async def test_rollout_cut_short_by_a_422_shows_why_it_stopped(story: Any) -> None:
    p, ids = story
    code, text = inspect(p.store_url, "--rollout", "r-stop")
    assert code == 0
    row = next(line for line in text.splitlines() if ids["stop_422"] in line)
    assert row.split()[:3] == ["1", ids["stop_422"], "rejected"]
    assert "HTTP 422 unknown_field" in row
    assert "messages[1].thinking_trace" in row
    last = text.splitlines()[-2]
    assert last.startswith(f"Last call #1 {ids['stop_422']} was rejected (HTTP 422, unknown_field)")
    assert "messages[1].thinking_trace" in last

    doc = inspect_json(p.store_url, "--rollout", "r-stop")
    staged, rejected = doc["calls"]
    assert (staged["seq"], staged["status"], staged["call_id"]) == (0, "staged", ids["stop_ok"])
    assert rejected == {
        "rollout_id": "r-stop",
        "seq": 1,
        "call_id": ids["stop_422"],
        "status": "rejected",
        "reason": "unknown_field",
        "http_status": 422,
        "message": rejected["message"],
        "at_ms": rejected["at_ms"],
    }
    assert "messages[1].thinking_trace" in rejected["message"]
    assert doc["last"] == rejected


async def test_poisoned_rollout_is_marked_loudly(story: Any) -> None:
    p, ids = story
    code, text = inspect(p.store_url, "--rollout", "r-poison")
    assert code == 0
    lines = text.splitlines()
    assert "POISONED" not in lines[0]
    assert lines[1].startswith(
        f"POISONED: answered but not staged: #1 {ids['poison_bad']} (missing_token_ids)"
    )
    row = next(line for line in lines if line.startswith("  1") or line.startswith("1 "))
    assert "capture_failed" in row
    doc = inspect_json(p.store_url, "--rollout", "r-poison")
    assert doc["rollout"]["poisoned"] is True
    assert [c["status"] for c in doc["calls"]] == ["staged", "capture_failed"]
    assert doc["calls"][1]["reason"] == "missing_token_ids"


async def test_drift_and_tool_calls_are_shown(story: Any) -> None:
    p, ids = story
    r0, r1 = p.calls("r-drift")
    full0 = list(r0.prompt_token_ids) + list(r0.completion_token_ids)
    shared = next(
        i for i, (a, b) in enumerate(zip(full0, r1.prompt_token_ids, strict=False)) if a != b
    )
    doc = inspect_json(p.store_url, "--rollout", "r-drift")
    c0, c1 = doc["calls"]
    assert c0["drift"] is None
    assert c0["tool_calls"] == [{"name": "bash", "arguments": '{"command": "ls"}'}]
    assert c0["reasoning"] == "I should look."
    assert c0["finish_reason"] == "tool_calls"
    assert c1["parent_call_id"] == ids["drift_0"]
    assert c1["drift"] == {
        "position": shared,
        "parent_len": len(full0),
        "prompt_len": len(r1.prompt_token_ids),
    }
    assert doc["trajectory"]["ok"] is True
    assert [d["call_id"] for d in doc["trajectory"]["drift"]] == [ids["drift_1"]]

    code, text = inspect(p.store_url, "--rollout", "r-drift")
    assert code == 0
    row0 = next(line for line in text.splitlines() if ids["drift_0"] in line.split()[1:2])
    assert 'think: I should look. | tool: bash({"command": "ls"})' in row0
    row1 = next(line for line in text.splitlines() if ids["drift_1"] in line.split()[1:2])
    assert row1.split()[6:9] == ["#0", "at", f"{shared}/{len(full0)}"]
    assert f"drift: {ids['drift_1']} at token {shared} of {len(full0)}" in text


async def test_retry_points_at_the_first_attempt(story: Any) -> None:
    p, ids = story
    code, text = inspect(p.store_url, "--rollout", "r-retry")
    assert code == 0
    row = next(line for line in text.splitlines() if ids["retry_1"] in line)
    assert "retry of #0" in row
    assert f"retried attempts skipped: {ids['retry_0']}" in text


async def test_orphaned_record_is_flagged_and_poisons(tmp_path: Path) -> None:
    sink = SQLiteSink(str(tmp_path / "s.db"))
    session = Session("r-orphan")
    for _ in range(2):
        record, atts = session.next()
        assert (await sink.stage(record, attachments=atts)).status is CallStatus.STAGED
    await sink.mark_orphaned("r-orphan-c1", "stage_timeout")
    await sink.close()
    url = f"sqlite:///{tmp_path / 's.db'}"
    code, text = inspect(url, "--rollout", "r-orphan")
    assert code == 0
    assert "POISONED: answered but not staged: #1 r-orphan-c1 (orphaned)" in text
    row = next(line for line in text.splitlines() if "r-orphan-c1" in line.split()[1:2])
    assert "staged, ORPHANED" in row
    doc = inspect_json(url)
    assert doc["rollouts"][0]["orphaned"] == 1
    assert doc["rollouts"][0]["poisoned"] is True


async def test_the_rollout_shows_its_latest_outcome(tmp_path: Path) -> None:
    sink = SQLiteSink(str(tmp_path / "s.db"))
    record, atts = Session("r-graded").next()
    assert (await sink.stage(record, attachments=atts)).status is CallStatus.STAGED
    first = RolloutOutcome(reward=0.0, group_id="g-7", at_ms=1_700_000_000_000)
    latest = RolloutOutcome(
        reward={"correct": 1.0, "format": 0.5},
        group_id="g-7",
        metadata={"judge": "rubric-v2"},
        at_ms=1_700_000_060_000,
    )
    header = RolloutInfo("r-graded", RolloutState.SEALED, False, 1, 2, {}, {}, (first, latest))
    await sink.put_rollout(header)
    await sink.close()
    url = f"sqlite:///{tmp_path / 's.db'}"
    code, text = inspect(url, "--rollout", "r-graded")
    assert code == 0
    assert (
        'outcome: reward {"correct":1.0,"format":0.5}, group g-7 '
        "(sent 2023-11-14 22:14:20 UTC; 1 earlier, replaced)"
    ) in text
    assert 'outcome metadata: {"judge":"rubric-v2"}' in text
    rollout = inspect_json(url, "--rollout", "r-graded")["rollout"]
    assert rollout["outcome"] == latest.to_dict()
    assert rollout["outcomes"] == 2
    # A rollout without an outcome says nothing of it.
    sink = SQLiteSink(str(tmp_path / "s.db"))
    await sink.put_rollout(RolloutInfo("r-plain", RolloutState.OPEN, False, 3))
    await sink.close()
    assert "outcome" not in inspect(url, "--rollout", "r-plain")[1]
    assert inspect_json(url, "--rollout", "r-plain")["rollout"]["outcome"] is None


# -- one call ---------------------------------------------------------------------------------


async def test_call_shows_the_fields_of_record_schema_2_only_when_set(tmp_path: Path) -> None:
    from dataclasses import replace

    from capture_proxy.schemas.digest import seal_record
    from tests.support.sink_factories import V2_VALUES

    sink = SQLiteSink(str(tmp_path / "s.db"))
    session = Session("r-v2")
    plain, _ = session.next()
    full, _ = session.next()
    full = seal_record(replace(full, **V2_VALUES))
    for record in (plain, full):
        assert (await sink.stage(record)).status is CallStatus.STAGED
    await sink.close()
    url = f"sqlite:///{tmp_path / 's.db'}"
    code, text = inspect(url, "--call", full.call_id)
    assert code == 0
    shown = {
        "effective sampling": "temperature=0.6 top_k=20 top_p=0.95",
        "logprobs mode": "processed_logprobs",
        "engine weights": "ckpt-7",
        "weight spans": "ckpt-7 [0, 5), ckpt-8 [5, 12) (completion positions)",
        "token-in": "yes",
        "inserted by proxy": "[3, 4) end_of_turn (prompt positions)",
        "replica": "http://vllm-0:8000",
    }
    for label, value in shown.items():
        assert re.search(rf"^  {re.escape(label)} +{re.escape(value)}$", text, re.M), label
    call = inspect_json(url, "--call", full.call_id)["call"]
    assert call["effective_sampling"] == V2_VALUES["effective_sampling"]
    assert call["weight_spans"] == [["ckpt-7", 0, 5], ["ckpt-8", 5, 12]]
    assert call["bridge_spans"] == [[3, 4, "end_of_turn"]]
    assert (call["token_in"], call["replica"], call["logprobs_mode"]) == (
        True,
        "http://vllm-0:8000",
        "processed_logprobs",
    )
    # A call with every new field at its "unknown" default shows none of them.
    code, text = inspect(url, "--call", plain.call_id)
    for label in ("effective sampling", "logprobs mode", "engine weights", "replica"):
        assert label not in text
    plain_doc = inspect_json(url, "--call", plain.call_id)["call"]
    assert not set(V2_VALUES) & set(plain_doc)


async def test_call_shows_image_as_media_type_size_and_sha256(story: Any) -> None:
    p, ids = story
    sha = hashlib.sha256(PNG).hexdigest()
    code, text = inspect(p.store_url, "--call", ids["image"])
    assert code == 0
    assert f"[image image/png 1.0 KiB sha256:{sha}]" in text
    assert f"attachment     image/png 1.0 KiB sha256:{sha} ok" in text
    assert "  check          ok" in text
    assert "base64" not in text
    doc = inspect_json(p.store_url, "--call", ids["image"])
    call = doc["call"]
    assert call["attachments"] == [
        {"sha256": sha, "media_type": "image/png", "size": len(PNG), "ok": True}
    ]
    part = call["request"]["messages"][0]["content"][1]
    assert part["image_url"]["url"] == f"attachment:sha256:{sha}"
    assert call["check"] == {"ok": True, "problem": None}
    (record,) = p.calls("r-image")
    assert call["digest"] == record.digest
    # The rollout view lists it too, shortened.
    code, text = inspect(p.store_url, "--rollout", "r-image")
    assert f"image/png 1.0 KiB sha256:{sha[:12]}" in text


async def test_call_shows_full_request_with_reasoning_tool_calls_and_results(story: Any) -> None:
    p, ids = story
    code, text = inspect(p.store_url, "--call", ids["drift_1"])
    assert code == 0
    _, r1 = p.calls("r-drift")
    assert f"  parent         {ids['drift_0']}" in text
    assert "  finish reason  " in text
    assert f"prompt {len(r1.prompt_token_ids)} + completion {len(r1.completion_token_ids)}" in text
    assert "  tools (1): bash" in text
    assert "      reasoning:\n        I should look." in text
    tc = r1.request["messages"][1]["tool_calls"][0]
    assert f'      tool call bash (id {tc["id"]}): {{"command":"ls"}}' in text
    assert f"  [2] tool (tool_call_id {tc['id']})\n      a.txt\n      b.txt" in text
    assert "Response" in text
    doc = inspect_json(p.store_url, "--call", ids["drift_1"])
    assert doc["call"]["request"] == r1.request
    assert doc["call"]["response"] == r1.response
    assert doc["call"]["stored"]["cum_len"] == r1.cum_len


async def test_rejected_call_shows_its_ledger_entry(story: Any) -> None:
    p, ids = story
    code, text = inspect(p.store_url, "--call", ids["stop_422"])
    assert code == 0
    assert text.startswith(f"Call {ids['stop_422']} was rejected, not staged")
    assert "  http status  422" in text
    doc = inspect_json(p.store_url, "--call", ids["stop_422"])
    assert doc["call"]["status"] == "rejected"
    assert doc["call"]["reason"] == "unknown_field"


async def test_tokens_prints_ids_and_logprobs(story: Any) -> None:
    p, ids = story
    (record,) = p.calls("r-image")
    code, text = inspect(p.store_url, "--call", ids["image"], "--tokens")
    assert code == 0
    assert f"Prompt token ids ({len(record.prompt_token_ids)})" in text
    prompt_lines = text.split("Prompt token ids")[1].split("Completion token ids")[0]
    assert [int(x) for x in prompt_lines.split()[1:]] == list(record.prompt_token_ids)
    first = f"  0  {record.completion_token_ids[0]:>5}"
    assert any(line.startswith("  0") for line in text.splitlines()), first
    doc = inspect_json(p.store_url, "--call", ids["image"], "--tokens")
    t = doc["call"]["tokens"]
    assert t["prompt_token_ids"] == list(record.prompt_token_ids)
    assert t["completion_token_ids"] == list(record.completion_token_ids)
    assert t["completion_logprobs"] == list(record.completion_logprobs)
    assert "prompt_text" not in t


def test_tokenizer_shows_each_id_with_its_text(
    story: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tokenizers  # a test dependency: this check never skips

    # A word-level tokenizer over the fake vLLM's byte vocabulary (byte b is id b + 16).
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<think>": 3, "</think>": 4}
    vocab.update({chr(b): b + 16 for b in range(33, 127)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    p, ids = story
    (record,) = p.calls("r-image")
    doc = inspect_json(p.store_url, "--call", ids["image"], "--tokenizer", str(path))
    t = doc["call"]["tokens"]
    inverse = {i: s for s, i in vocab.items()}
    assert t["prompt_text"] == [tok.decode([i]) for i in record.prompt_token_ids]
    assert t["prompt_text"][0] == "<|im_start|>"
    letters = [(i, x) for i, x in zip(t["completion_token_ids"], t["completion_text"], strict=True)]
    assert all(x == inverse[i] for i, x in letters if i in inverse and i > 32 + 16)
    code, text = inspect(p.store_url, "--call", ids["image"], "--tokenizer", str(path))
    assert code == 0
    assert '"<|im_start|>"' in text.split("Prompt token ids")[1]
    assert text.split("Completion token ids")[1].splitlines()[1].split() == [
        "POS",
        "ID",
        "LOGPROB",
        "TEXT",
    ]
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"not": "a tokenizer"}')
    capsys.readouterr()
    code, text = inspect(p.store_url, "--call", ids["image"], "--tokenizer", str(garbage))
    assert (code, text) == (2, "")
    err = capsys.readouterr().err
    assert err.startswith(f"capture-proxy inspect: --tokenizer: {garbage} is not a tokenizer.json")
    assert err.count("\n") == 1


async def test_tokenizer_without_the_package_says_to_install_it(story: Any) -> None:
    p, ids = story
    code = (
        "import sys; sys.modules['tokenizers'] = None\n"  # as if it were not installed
        "from capture_proxy.cli import main; raise SystemExit(main())"
    )
    argv = [sys.executable, "-c", code, "inspect", p.store_url, "--call", ids["image"]]
    argv += ["--tokenizer", "t.json"]
    out = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr == (
        "capture-proxy inspect: --tokenizer needs the tokenizers package, which is not "
        "installed: pip install tokenizers\n"
    )


# -- verify -----------------------------------------------------------------------------------


async def test_verify_clean_store_then_a_flipped_token_byte(
    story_store: Story, tmp_path: Path
) -> None:
    p = story_store.copy(tmp_path)
    ids = p.ids
    code, text = inspect(p.store_url, "--verify")
    assert code == 0
    assert text == f"ok: 7 record(s) in {p.store_url} verify\n"
    before = _delta_tokens(p.store_url, ids["stop_ok"])
    _flip_first_token_byte(p.store_url, ids["stop_ok"])
    assert _delta_tokens(p.store_url, ids["stop_ok"]) != before

    # A real process, as a person or a CI job runs it.
    out = await asyncio.to_thread(run, p.store_url, "--verify")
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"1 problem(s) in {p.store_url} (7 record(s) checked):"
    assert lines[1].startswith(f"  {ids['stop_ok']}: ")
    assert "digest" in lines[1]
    assert out.stderr == ""

    code, text = inspect(p.store_url, "--verify", "--json")
    assert code == 1
    doc = orjson.loads(text)
    assert (doc["view"], doc["ok"], doc["checked"]) == ("verify", False, 7)
    assert [x["key"] for x in doc["problems"]] == [ids["stop_ok"]]
    # The call view shows the same failed check, with the same exit status.
    code, text = inspect(p.store_url, "--call", ids["stop_ok"], "--json")
    assert code == 1
    call = orjson.loads(text)["call"]
    assert call["check"]["ok"] is False
    assert ids["stop_ok"] in call["check"]["problem"]


# -- errors -----------------------------------------------------------------------------------


def test_missing_store_is_one_sentence_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.db"
    out = run(str(missing))
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1
    assert str(missing) in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("capture-proxy inspect: no capture-proxy store at")


async def test_unknown_ids_and_bad_flags_are_one_sentence(
    story: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    p, ids = story
    cases = [
        (["--rollout", "r-none"], f"no rollout 'r-none' in {p.store_url}"),
        (["--call", "c-none"], f"no call 'c-none' in {p.store_url}"),
        (["--tokens"], "--tokens and --tokenizer go with --call ID"),
        (["--call", ids["image"], "--follow"], "--follow follows the store or one --rollout"),
        (["--call", ids["image"], "--tokenizer", "/nonexistent/t.json"], "no file at"),
    ]
    for argv, want in cases:
        code, text = inspect(p.store_url, *argv)
        err = capsys.readouterr().err
        assert code == 2, argv
        assert text == ""
        assert err.startswith("capture-proxy inspect: "), err
        assert want in err, err
        assert err.count("\n") == 1
    not_a_store = p.store_url.removeprefix("sqlite:///") + ".txt"
    await asyncio.to_thread(Path(not_a_store).write_text, "hello")
    assert inspect(f"sqlite:///{not_a_store}")[0] == 2
    assert "not a capture-proxy store" in capsys.readouterr().err


def test_capture_proxy_inspect_is_the_same_command(
    story_store: Story, capsys: pytest.CaptureFixture[str]
) -> None:
    from capture_proxy.cli import main as capture_proxy_main

    url = story_store.store_url
    assert capture_proxy_main(["inspect", url, "--rollout", "r-stop"]) == 0
    assert capsys.readouterr().out == inspect(url, "--rollout", "r-stop")[1]
    assert capture_proxy_main(["inspect", url, "--rollout", "nope"]) == 2
    assert capsys.readouterr().err == f"capture-proxy inspect: no rollout 'nope' in {url}\n"


def test_interval_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["x.db", "--follow", "--interval", "0"])
    assert exc.value.code == 2
    assert "--interval must be between 0.05 and 60.0 seconds" in capsys.readouterr().err


# -- output for terminals ---------------------------------------------------------------------


async def test_rich_table_fits_the_terminal_and_prints_markup_literally(story: Any) -> None:
    p, ids = story
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with open_store(p.store_url) as store:
        render_rollout(rollout_view(store, "r-stop"), RichOut(console))
        render_call(call_view(store, ids["stop_ok"]), RichOut(console))
    raw = buf.getvalue()
    assert "\x1b[1;31m" in raw, "the rejected call is not in bold red"
    text = ANSI.sub("", raw)
    lines = text.splitlines()
    assert all(len(line) <= 120 for line in lines)
    header = next(line for line in lines if "PREVIEW" in line)
    assert header.split() == ["SEQ", "CALL", "STATUS", "FINISH", "PROMPT", "COMPL", "PREVIEW"]
    row = next(line for line in lines if ids["stop_422"] in line)
    assert row.split()[:3] == ["1", ids["stop_422"], "rejected"]
    assert "HTTP 422 unknown_field" in row
    assert "look at [bold]this[/bold]" in text  # user text is never taken for markup


def test_narrow_terminal_hides_columns_and_says_so() -> None:
    columns = [Column("ID"), Column("A", hide=2), Column("B", hide=1), Column("TEXT", flex=1)]
    rows = [["x" * 20, "a" * 10, "b" * 10, "t" * 100]]
    buf = io.StringIO()
    RichOut(Console(file=buf, width=60)).table(columns, rows, [False])
    lines = buf.getvalue().splitlines()
    assert lines[0].split() == ["ID", "B", "TEXT"]
    assert lines[2].startswith("x" * 20 + "   " + "b" * 10 + "   ttt")
    assert lines[2].rstrip().endswith("…")
    assert len(lines[2]) <= 60
    assert lines[3] == "(hidden to fit: A; widen the terminal or use --json)"


def _read_pty(fd: int, deadline: float) -> bytes:
    chunks = []
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError as e:  # EIO: the child closed the terminal
            if e.errno == errno.EIO:
                break
            raise
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _run_on_terminal(argv: list[str], columns: int) -> tuple[int, str]:
    """Run inspect with its stdout on a real pseudo-terminal `columns` wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    proc = subprocess.Popen(
        [*RUN, *argv], stdout=slave, stderr=subprocess.DEVNULL, env={**env, "TERM": "xterm"}
    )
    os.close(slave)
    try:
        raw = _read_pty(master, time.monotonic() + 20)
        return proc.wait(timeout=20), raw.decode()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


async def test_real_terminal_gets_a_table_sized_to_it(story: Any) -> None:
    p, ids = story
    code, raw = await asyncio.to_thread(_run_on_terminal, [p.store_url, "--rollout", "r-drift"], 90)
    assert code == 0
    assert ANSI.search(raw), "no colour on a terminal"
    lines = ANSI.sub("", raw).replace("\r", "").splitlines()
    assert all(len(line) <= 90 for line in lines), max(lines, key=len)
    header = next(line for line in lines if "PREVIEW" in line)
    assert header.split()[:3] == ["SEQ", "CALL", "STATUS"]
    assert any(ids["drift_1"] in line and "at " in line for line in lines)


# -- follow -----------------------------------------------------------------------------------


async def test_follow_prints_new_calls_as_the_live_store_grows(make_proxy: Any) -> None:
    p = await make_proxy()
    first = await _chat(p, chat_body(user("one")), "r1", "staged")
    proc = await asyncio.create_subprocess_exec(
        *RUN,
        p.store_url,
        "--rollout",
        "r1",
        "--follow",
        "--interval",
        "0.1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        banner = await asyncio.wait_for(proc.stderr.readline(), 15)
        assert banner.decode().startswith(f"following {p.store_url} every 0.1s")
        second = await _chat(p, chat_body(user("two")), "r1", "staged")
        bad = chat_body({"role": "user", "content": "x", "bogus": 1})
        rejected = await _chat(p, bad, "r1", "rejected")
        await _chat(p, chat_body(user("elsewhere")), "r-other", "staged")
        seen: list[str] = []
        deadline = time.monotonic() + 15
        while not any(rejected in line for line in seen) and time.monotonic() < deadline:
            line = await asyncio.wait_for(proc.stdout.readline(), 15)
            seen.append(line.decode())
    finally:
        if proc.returncode is None:
            proc.terminate()
        code = await asyncio.wait_for(proc.wait(), 15)
    assert code == 0  # SIGTERM ends a follow cleanly, like Ctrl-C
    text = "".join(seen)
    assert first in text.split("Last call")[0]  # the initial view
    new = [line for line in seen if line.startswith("#")]
    assert [line.split()[:3] for line in new] == [
        ["#1", second, "staged"],
        ["#2", rejected, "rejected"],
    ]
    r0, r1 = p.calls("r1")
    assert r1.parent_call_id == r0.call_id  # a new user turn shares the template's first tokens
    full0 = len(r0.prompt_token_ids) + len(r0.completion_token_ids)
    assert (
        f"stop prompt {len(r1.prompt_token_ids)} completion {len(r1.completion_token_ids)} "
        f"parent #0 DRIFT at " in new[0]
    )
    assert new[0].split(" | ")[0].endswith(f"/{full0}")
    assert "| HTTP 422 unknown_field: " in new[1]
    assert "r-other" not in text


async def test_follower_reports_new_calls_once_with_drift(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'f.db'}"
    sink = open_sink(url)
    session = Session("r1", image=image("cat"))
    for _ in range(2):
        record, atts = session.next()
        await sink.stage(record, attachments=atts)
    with open_store(url) as store:
        follower = Follower(store)
        assert follower.poll() == []
        record, atts = session.next(drift_at=5)
        await sink.stage(record, attachments=atts)
        await sink.record_failure(
            LedgerEntry("r2", "r2-c0", 0, CallStatus.UPSTREAM_ERROR, "upstream_503", "busy", 503)
        )
        polled, failed = follower.poll()
        assert follower.poll() == []
    await sink.close()
    staged = cast("StagedEntry", polled)
    assert staged["call_id"] == "r1-c2"
    assert staged["parent_call_id"] == "r1-c1"
    drift = staged["drift"]
    assert drift is not None
    assert drift["position"] == 5
    assert drift["prompt_len"] == 5 + 40
    assert staged["attachments"][0]["media_type"] == "image/png"
    assert failed == {
        "rollout_id": "r2",
        "seq": 0,
        "call_id": "r2-c0",
        "status": "upstream_error",
        "reason": "upstream_503",
        "http_status": 503,
        "message": "busy",
        "at_ms": 0,
    }


# -- Parquet ----------------------------------------------------------------------------------


async def test_parquet_dataset_made_by_the_proxy(make_proxy: Any, tmp_path: Path) -> None:
    url = f"parquet:///{tmp_path / 'dataset'}"
    p = await make_proxy(sink=open_sink(url))
    ok = await _chat(p, chat_body(user("hello")), "r-pq", "staged")
    bad = chat_body(user("a"), {"role": "assistant", "content": "b", "thinking_trace": "t"})
    rejected = await _chat(p, bad, "r-pq", "rejected")
    await p.sink.close()  # publish everything the group commit holds

    doc = inspect_json(url, "--rollout", "r-pq")
    assert [(c["call_id"], c["status"]) for c in doc["calls"]] == [
        (ok, "staged"),
        (rejected, "rejected"),
    ]
    assert doc["calls"][1]["http_status"] == 422
    code, text = inspect(url)
    assert code == 0
    assert text.splitlines()[2].split()[:4] == ["r-pq", "open", "2", "1"]
    assert inspect(url, "--verify") == (0, f"ok: 1 record(s) in {url} verify\n")
    call = inspect_json(url, "--call", ok)["call"]
    assert call["check"]["ok"] is True
    assert call["prompt_tokens"] > 0


async def test_follow_json_waits_for_a_rollout_that_has_not_started(make_proxy: Any) -> None:
    p = await make_proxy()
    await _chat(p, chat_body(user("setup")), "r0", "staged")  # the store exists, r-later not
    proc = await asyncio.create_subprocess_exec(
        *RUN,
        p.store_url,
        "--rollout",
        "r-later",
        "--follow",
        "--json",
        "--interval",
        "0.1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        notes = [(await asyncio.wait_for(proc.stderr.readline(), 15)).decode() for _ in range(2)]
        assert notes[0] == f"no rollout 'r-later' in {p.store_url} yet: waiting\n"
        assert notes[1].startswith("following ")
        staged = await _chat(p, chat_body(user("now")), "r-later", "staged")
        p.fake.push(Turn(fault=Fault.http_error(503, {"error": {"message": "overloaded"}})))
        failed = await _chat(p, chat_body(user("again")), "r-later", "upstream_error")
        events = [
            orjson.loads(await asyncio.wait_for(proc.stdout.readline(), 15)) for _ in range(2)
        ]
    finally:
        proc.terminate()
        code = await asyncio.wait_for(proc.wait(), 15)
    assert code == 0
    first, second = events
    assert (first["event"], first["call_id"], first["status"]) == ("call", staged, "staged")
    assert first["rollout_id"] == "r-later"
    assert first["prompt_tokens"] == len(p.calls("r-later")[0].prompt_token_ids)
    assert (second["call_id"], second["status"], second["http_status"]) == (
        failed,
        "upstream_error",
        503,
    )
    assert second["reason"] == "upstream_503"


# -- damaged stores and broken pipes ----------------------------------------------------------


def test_unreadable_rollout_is_one_sentence_and_verify_lists_it(
    story_store: Story, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = story_store.copy(tmp_path)
    with sqlite3.connect(p.path) as db:  # the drifted call's parent row goes missing
        db.execute("DELETE FROM calls WHERE call_id = ?", (p.ids["drift_0"],))
    db.close()
    code, text = inspect(p.store_url, "--rollout", "r-drift")
    err = capsys.readouterr().err
    assert (code, text) == (2, "")
    assert err.startswith("capture-proxy inspect: rollout 'r-drift' cannot be read (")
    assert err.endswith("; run inspect --verify\n")
    assert err.count("\n") == 1
    code, text = inspect(p.store_url, "--verify")
    assert code == 1
    assert f"  {p.ids['drift_1']}: unreadable: " in text
    # The rest of the store still reads.
    assert inspect(p.store_url, "--rollout", "r-stop")[0] == 0


class _BrokenTrajectories(Store):
    """A store whose trajectory builder fails (as while trajectory.py is being changed)."""

    def trajectory(self, rollout_id: str, **options: Any) -> Any:
        raise RuntimeError("segments do not add up")


def test_failing_trajectory_leaves_a_note_and_everything_else(story_store: Story) -> None:
    store = _BrokenTrajectories(open_source(story_store.store_url))
    with store:
        view = rollout_view(store, "r-drift")
    assert view["trajectory"] == {
        "ok": False,
        "note": "trajectory unavailable: RuntimeError: segments do not add up",
    }
    assert [c["status"] for c in view["calls"]] == ["staged", "staged"]
    assert cast("StagedEntry", view["calls"][1])["drift"] is not None
    buf = io.StringIO()
    render_rollout(view, PlainOut(buf))
    assert buf.getvalue().endswith("trajectory unavailable: RuntimeError: segments do not add up\n")


class _ClosedPipe(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_reader_that_went_away_is_not_an_error(
    story_store: Story, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([story_store.store_url, "--rollout", "r-stop"], stdout=_ClosedPipe()) == 0
    assert capsys.readouterr().err == ""


# -- the JSON keys are documented -------------------------------------------------------------

_FREE_FORM = {"request", "response", "sampling", "extras", "metadata", "statuses", "tokens"}


def _keys(value: Any, found: set[str]) -> set[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            found.add(k)
            if k not in _FREE_FORM:
                _keys(v, found)
    elif isinstance(value, list):
        for v in value:
            _keys(v, found)
    return found


def test_every_json_key_is_documented(story_store: Story) -> None:
    url, ids = story_store.store_url, story_store.ids
    docs = (ROOT / "docs" / "inspect.md").read_text()
    views = [inspect_json(url), inspect_json(url, "--verify")]
    views += [
        inspect_json(url, "--rollout", r) for r in ("r-stop", "r-drift", "r-retry", "r-image")
    ]
    views += [inspect_json(url, "--call", ids[k], "--tokens") for k in ("image", "stop_422")]
    tokens = views[-2]["call"]["tokens"]
    keys = _keys(views, set()) | set(tokens) | {"event"}
    missing = sorted(k for k in keys if not re.search(rf"\b{re.escape(k)}\b", docs))
    assert missing == []
    for view in views:
        assert f'`view: "{view["view"]}"`' in docs


async def test_empty_store_and_a_sealed_rollout_without_calls(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'e.db'}"
    sink = open_sink(url)
    await sink.put_rollout(RolloutInfo("r-none", RolloutState.OPEN, False, 1_700_000_000_000))
    await sink.close()
    code, text = inspect(url, "--rollout", "r-none")
    assert code == 0
    assert "(no calls yet)" in text
    assert inspect_json(url, "--rollout", "r-none")["last"] is None
    sink = open_sink(url)
    await sink.put_rollout(
        RolloutInfo("r-none", RolloutState.SEALED, False, 1_700_000_000_000, 1_700_000_005_000)
    )
    await sink.close()
    (summary,) = inspect_json(url)["rollouts"]
    assert (summary["state"], summary["calls"], summary["first_at_ms"]) == ("sealed", 0, None)
    assert summary["sealed_at_ms"] == 1_700_000_005_000
    code, text = inspect(url)
    assert text.splitlines()[2].split() == ["r-none", "sealed", "0", "-", "0", "0", "-", "-"]


async def test_store_with_no_rollouts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    sink = open_sink(url)
    await sink.put_rollout(RolloutInfo("r-x", RolloutState.OPEN, False, 1))  # creates the file
    await sink.close()
    with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
        db.execute("DELETE FROM rollouts")
    db.close()
    assert inspect(url) == (0, f"0 rollout(s) in {url}, newest first\n(no rollouts yet)\n")
    assert inspect_json(url)["rollouts"] == []
    assert inspect(url, "--verify") == (0, f"ok: 0 record(s) in {url} verify\n")
