"""The fake vLLM's ``--script FILE``: turns, tool calls and faults from JSON, with errors that
name the entry; run from the shell, its tool calls are captured by a proxy in front of it."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from capture_proxy.read.reader import open_store
from capture_proxy.server.app import create_app
from capture_proxy.server.settings import Settings
from capture_proxy.testing.fake_vllm import FakeToolCall, Fault, Turn, load_script, parse_script

Client = TestClient[web.Request, web.Application]

SCRIPT = [
    {
        "reasoning": "look first",
        "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}],
    },
    {"content": "Two files.", "finish_reason": "stop"},
    {"content": "late", "fault": {"kind": "delay_first_byte", "seconds": 0.5}},
    {"fault": {"kind": "http_error", "status": 503}},
    {"fault": {"kind": "error_event", "after": 2, "message": "oom"}},
    {"fault": {"kind": "drop_token_ids", "every": None}},
]


def test_a_script_maps_onto_turns_tool_calls_and_faults() -> None:
    assert parse_script(SCRIPT) == [
        Turn("", "look first", [FakeToolCall("bash", {"command": "ls"})]),
        Turn("Two files.", finish_reason="stop"),
        Turn("late", fault=Fault.delay_first_byte(0.5)),
        Turn(fault=Fault.http_error(503)),
        Turn(fault=Fault.error_event(after=2, message="oom")),
        Turn(fault=Fault.drop_token_ids(None)),
    ]


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ({"content": "hi"}, "$: expected an array of turns, got an object"),
        (["hi"], "$[0]: expected an object, got the string 'hi'"),
        ([{}, {"tool_call": []}], "$[1]: unknown key 'tool_call' (known: content, reasoning, "),
        ([{"content": 3}], "$[0].content: expected a string, got the number 3"),
        ([{"tool_calls": [{"arguments": {}}]}], "$[0].tool_calls[0]: a tool call needs a name"),
        (
            [{"tool_calls": [{"name": "bash", "arguments": "ls"}]}],
            "$[0].tool_calls[0].arguments: expected an object, got the string 'ls'",
        ),
        ([{"fault": {"kind": "boom"}}], "$[0].fault.kind: expected one of http_error, "),
        ([{"fault": {"kind": "http_error"}}], "$[0].fault: a http_error fault needs status"),
        (
            [{"fault": {"kind": "http_error", "status": True}}],
            "$[0].fault.status: expected an integer, got a boolean",
        ),
        (
            [{"fault": {"kind": "hang", "seconds": 1}}],
            "$[0].fault: a hang fault takes no 'seconds' (its arguments: none)",
        ),
        (
            [{"fault": {"kind": "reset_after", "after": 1}}],
            "$[0].fault: a reset_after fault takes no 'after' (its arguments: n_chunks)",
        ),
        (
            [{"fault": {"kind": "delay_first_byte", "seconds": "2"}}],
            "$[0].fault.seconds: expected a number, got the string '2'",
        ),
    ],
)
def test_a_wrong_script_is_refused_naming_the_entry(script: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_script(script)


def test_a_file_that_is_not_json_or_not_there_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "turns.json"
    bad.write_text("[{'content': 'single quotes'}]")
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))} is not JSON: "):
        load_script(str(bad))
    missing = re.escape(str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match=f"^cannot read {missing}: No such file"):
        load_script(str(tmp_path / "none.json"))
    bad.write_text('[{"content": 1}]')
    with pytest.raises(ValueError, match=re.escape(f"{bad}: $[0].content: expected a string")):
        load_script(str(bad))


def test_the_command_refuses_a_wrong_script_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "turns.json"
    script.write_text('[{"tool_calls": [{"arguments": {}}]}]')
    done = subprocess.run(
        [sys.executable, "-m", "capture_proxy.fake_vllm", "--script", str(script)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"python -m capture_proxy.fake_vllm: error: --script {script}: "
        "$[0].tool_calls[0]: a tool call needs a name"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def scripted_fake(tmp_path: Path) -> Iterator[str]:
    """``python -m capture_proxy.fake_vllm --script`` with SCRIPT's first two turns and a fault."""
    script = tmp_path / "turns.json"
    script.write_text(json.dumps([*SCRIPT[:2], SCRIPT[3]]))
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "capture_proxy.fake_vllm", "--port", str(port), "--script", script],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        assert f"3 scripted turn(s) from {script}, then echo answers" in err


async def test_a_scripted_tool_call_is_captured_through_the_proxy(
    scripted_fake: str, aiohttp_client: Callable[[web.Application], Awaitable[Client]]
) -> None:
    store = "memory://fake-script-demo"
    settings = Settings(upstream=scripted_fake, store=store, min_free_disk_mb=0)
    proxy = await aiohttp_client(create_app(settings))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what is here?"}]
    tools = [
        {
            "type": "function",
            "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    first = await proxy.post(
        "/r/demo/v1/chat/completions",
        json={"model": "policy", "messages": messages, "tools": tools},
    )
    assert first.headers["X-Capture-Status"] == "staged"
    message = (await first.json())["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "bash", "arguments": '{"command": "ls"}'}
    messages += [
        {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": call["id"], "content": "a.txt b.txt"},
    ]
    second = await proxy.post(
        "/r/demo/v1/chat/completions",
        json={"model": "policy", "messages": messages, "tools": tools},
    )
    answer = await second.json()
    assert second.status == 200, answer
    assert answer["choices"][0]["message"]["content"] == "Two files."
    third = await proxy.post(
        "/r/demo/v1/chat/completions",
        json={"model": "policy", "messages": messages, "tools": tools},
    )
    assert third.headers["X-Capture-Status"] == "upstream_error"  # the scripted 503
    await proxy.close()
    with open_store(store) as reader:
        staged = reader.calls("demo", include_open=True, include_poisoned=True)
        (failed,) = reader.failures("demo")
    assert [r.finish_reason for r in staged] == ["tool_calls", "stop"]
    assert staged[0].response["tool_calls"][0]["function"]["name"] == "bash"
    assert staged[0].response["reasoning_content"] == "look first"
    assert failed.status == "upstream_error"
