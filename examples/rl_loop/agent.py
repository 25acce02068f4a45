"""A scripted agent: an OpenAI-SDK client working a task in a few turns through its rollout's URL.

It is what a sandbox runs, reduced to its protocol: it offers a `bash` tool, replays each answer
as the SDK returned it (reasoning as `reasoning`, as OpenCode does), runs the tool calls the
model makes and sends their results as ``tool`` messages, and after an answer without a tool call
sends the next command of its script as a user turn.

A real policy calls tools on its own. The tiny random model of the CI never does, so the loop
can ask for a tool call on every other turn with `steer` (extra request keys, e.g. a
``structured_outputs`` regex of the call): those turns are guided decoding, whose logprobs come
from the grammar-masked distribution, so the trainer leaves them out of its check and its loss
(`batch.Sample.samplings`' ``guided``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from openai import OpenAI

__all__ = ["TOOLS", "Transcript", "play"]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
SYSTEM = "You are a coding agent. Use the tools."
#: The commands the agent works through: asked for as tool calls on steered turns, else sent
#: with their output as the next user turn.
SCRIPT = ("ls", "cat README.md", "wc -l main.py")
FAKE_OUTPUT = {
    "ls": "README.md\nmain.py",
    "cat README.md": "# demo",
    "wc -l main.py": "12 main.py",
}


@dataclass
class Transcript:
    """What the agent saw: the model's replies (reasoning + content), for the grader."""

    replies: list[str] = field(default_factory=list)
    tool_calls: int = 0

    @property
    def text(self) -> str:
        return "\n".join(self.replies)


def _run(command: str) -> str:
    return FAKE_OUTPUT.get(command, f"{command}: not found")


def _replayed(message: Any) -> dict[str, Any]:
    """The assistant message sent back on the next turn: content, reasoning, tool calls."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    reasoning = (message.model_extra or {}).get("reasoning") or (message.model_extra or {}).get(
        "reasoning_content"
    )
    if reasoning:
        out["reasoning"] = reasoning
    calls = [c.model_dump() for c in message.tool_calls or () if c.type == "function"]
    if calls:
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": c["function"]} for c in calls
        ]
    return out


def play(
    base_url: str,
    api_key: str,
    task: str,
    *,
    turns: int,
    sampling: Mapping[str, Any],
    steer: Callable[[str], Mapping[str, Any]] | None = None,
    model: str = "policy",
) -> Transcript:
    """Work `task` for `turns` model calls through `base_url` (a rollout's ``/r/{id}/v1`` URL)
    with the request's `sampling` (``temperature``, ``top_p``, ``max_tokens``, ...). With
    `steer`, turns 0, 2, ... add ``steer(command)`` to the request to have the model call the
    tool with the script's next command."""
    client = OpenAI(base_url=base_url, api_key=api_key or "unused", max_retries=0, timeout=120)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task},
    ]
    transcript = Transcript()
    script = iter(SCRIPT * turns)
    for turn in range(turns):
        body = dict(sampling)
        if steer is not None and turn % 2 == 0:
            body.update(steer(next(script)))
        answer = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            extra_body=body,  # vLLM's keys (structured_outputs, ...) beside OpenAI's
        )
        replay = _replayed(answer.choices[0].message)
        transcript.replies.append(f"{replay.get('reasoning', '')}{replay['content']}")
        messages.append(replay)
        if replay.get("tool_calls"):
            transcript.tool_calls += len(replay["tool_calls"])
            for call in replay["tool_calls"]:
                try:
                    command = str(json.loads(call["function"]["arguments"]).get("command", ""))
                except (ValueError, AttributeError):
                    command = ""
                result = {"role": "tool", "tool_call_id": call["id"], "content": _run(command)}
                messages.append(result)
        else:
            command = next(script)
            messages.append({"role": "user", "content": f"$ {command}\n{_run(command)}"})
    return transcript
