"""Rollouts staged through a real proxy (bundled fake vLLM) for the trainer adapter tests, and
the bridge to the trainers' own code (tests/support/trainer_check.py in the cached venv).

The store holds two graded groups, every rollout sealed:
- ``task-1``: ``t1-a`` and ``t1-b``, each a tool-call turn (finish reason ``tool_calls``: the
  first segment), then a call whose history was edited (drift: a second segment) and its
  replay with a new user message (the same segment). ``t1-a``'s reward is an object
  ``{"pass": 1.0, "style": 0.5}``, ``t1-b``'s is 0.0.
- ``task-2``: ``t2-a`` sends a real PNG (reward 1.0), ``t2-b`` is cut by ``max_tokens``
  (finish reason ``length``, reward 0.25).
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
from scripts.trainer_env import prepare
from tests.support import ROOT
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user

TOKEN = "0123456789abcdef0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
OUTCOMES: dict[str, dict[str, Any]] = {
    "t1-a": {"reward": {"pass": 1.0, "style": 0.5}, "group_id": "task-1"},
    "t1-b": {"reward": 0.0, "group_id": "task-1"},
    "t2-a": {"reward": 1.0, "group_id": "task-2"},
    "t2-b": {"reward": 0.25, "group_id": "task-2"},
}
#: The PNG's width and height.
IMAGE_SIZE = (56, 28)


def png(width: int = IMAGE_SIZE[0], height: int = IMAGE_SIZE[1]) -> bytes:
    """A real (decodable) RGB PNG of one colour."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(b"\x00" + b"\xc0\x40\x20" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


async def _ok(p: Proxy, body: dict[str, Any], rollout: str) -> dict[str, Any]:
    resp = await p.chat(body, rollout=rollout)
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Capture-Status"] == "staged"
    answer: dict[str, Any] = await resp.json()
    return answer


async def _tool_rollout(p: Proxy, rollout: str) -> None:
    p.fake.push(
        Turn("", tool_calls=[FakeToolCall("bash", {"command": "ls"})]),
        Turn("Two files."),
        Turn("Done."),
    )
    first = await _ok(p, chat_body(user("list files"), tools=TOOLS), rollout)
    call = first["choices"][0]["message"]["tool_calls"][0]
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": call["id"], "content": "a.txt\nb.txt"}
    # The agent rewrote its first message: the prompt no longer extends what the model saw, so
    # the first segment ends with the tool-call turn.
    edited = user("list the files in this folder")
    second = await _ok(p, chat_body(edited, turn, result, tools=TOOLS), rollout)
    answer = {"role": "assistant", "content": second["choices"][0]["message"]["content"]}
    # Replayed as it was: the same segment, the user's new message inside its response.
    await _ok(p, chat_body(edited, turn, result, answer, user("thanks"), tools=TOOLS), rollout)


async def _image_rollout(p: Proxy, rollout: str) -> None:
    p.fake.push(Turn("A small orange image."))
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    parts = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    await _ok(p, chat_body({"role": "user", "content": parts}, tools=TOOLS), rollout)


async def _cut_rollout(p: Proxy, rollout: str) -> None:
    p.fake.push(Turn("This answer goes on for far longer than the limit allows it to."))
    await _ok(p, chat_body(user("explain"), tools=TOOLS, max_tokens=4), rollout)


async def stage_rollouts(tmp_path: Path) -> str:
    """Stage, seal and grade the module's rollouts; return the store's URL."""
    p = await start_proxy(tmp_path, fake=FakeVLLM(), admin_token=TOKEN)
    try:
        for rollout in OUTCOMES:
            made = await p.client.post(
                "/admin/rollouts", json={"rollout_id": rollout}, headers=ADMIN
            )
            assert made.status == 201, await made.text()
        await _tool_rollout(p, "t1-a")
        await _tool_rollout(p, "t1-b")
        await _image_rollout(p, "t2-a")
        await _cut_rollout(p, "t2-b")
        for rollout, outcome in OUTCOMES.items():
            sealed = await p.client.post(f"/admin/rollouts/{rollout}/seal", headers=ADMIN)
            assert sealed.status == 200, await sealed.text()
            graded = await p.client.put(
                f"/admin/rollouts/{rollout}/outcome", json=outcome, headers=ADMIN
            )
            assert graded.status == 200, await graded.text()
    finally:
        await stop_proxy(p)
    return p.store_url


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class TrainerRefused(AssertionError):
    """The trainer's own code refused the payload; the message is the trainer's."""


def run_checks(*checks: tuple[str, Any]) -> list[dict[str, Any] | TrainerRefused]:
    """Run each ``(check, payload)`` (tests/support/trainer_check.py) in one process of the
    trainers' venv, installed on first use: per check, the trainer's answer, or a
    `TrainerRefused` carrying the trainer's own error."""
    python = prepare().python
    proc = subprocess.run(
        [str(python), "-m", "tests.support.trainer_check"],
        input=json.dumps([{"check": c, "payload": _jsonable(p)} for c, p in checks]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, f"the trainer check crashed:\n{proc.stderr[-4000:]}"
    return [
        TrainerRefused(a["refused"]) if "refused" in a else a["ok"] for a in json.loads(proc.stdout)
    ]


def run_check(check: str, payload: Any) -> dict[str, Any]:
    """`run_checks` of one check; raises `TrainerRefused` when the trainer refuses it."""
    (answer,) = run_checks((check, payload))
    if isinstance(answer, TrainerRefused):
        raise answer
    return answer
