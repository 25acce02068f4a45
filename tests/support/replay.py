"""A client that replays a session as OpenCode does, for the end-to-end token-in tests.

`read_answer` reads a Chat Completions answer through the proxy, streamed or not, into the
assistant message the client saw (content, ``reasoning``, tool calls: a stream's deltas joined).
`replayed` turns it into the message OpenCode sends back on its next call: ``content`` a string
(``""`` for none), the reasoning as ``reasoning`` (OpenCode's ``interleaved.field``), and each
tool call's arguments re-serialized compactly (``{"command":"ls -la"}``), as OpenCode does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.support.proxy_harness import sse_lines


@dataclass
class Answer:
    """What the client saw of one call."""

    call_id: str
    status: str  # X-Capture-Status, or the stream's ``: capture-status`` outcome
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


async def read_answer(resp: aiohttp.ClientResponse, *, stream: bool) -> Answer:
    """The answer of a 200 response; fails the test with the body otherwise."""
    assert resp.status == 200, (await resp.read())[:2000]
    call_id = resp.headers["X-Capture-Call-Id"]
    if not stream:
        message = (await resp.json())["choices"][0]["message"]
        return Answer(
            call_id,
            resp.headers["X-Capture-Status"],
            message.get("content") or "",
            message.get("reasoning") or "",
            list(message.get("tool_calls") or []),
        )
    answer = Answer(call_id, "")
    calls: dict[int, dict[str, Any]] = {}
    async for line in sse_lines(resp):
        if line.startswith(b": capture-status "):
            answer.status = line.decode().split()[2]
        elif line.startswith(b"data: {"):
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                answer.content += delta.get("content") or ""
                answer.reasoning += delta.get("reasoning") or ""
                for piece in delta.get("tool_calls") or []:
                    call = calls.setdefault(
                        piece["index"], {"type": "function", "function": {"arguments": ""}}
                    )
                    if piece.get("id"):
                        call["id"] = piece["id"]
                    function = piece.get("function") or {}
                    if function.get("name"):
                        call["function"]["name"] = function["name"]
                    call["function"]["arguments"] += function.get("arguments") or ""
    answer.tool_calls = [calls[i] for i in sorted(calls)]
    return answer


def replayed(answer: Answer) -> dict[str, Any]:
    """The assistant message OpenCode sends back for `answer` on its next call."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning:
        message["reasoning"] = answer.reasoning
    if answer.tool_calls:
        message["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": json.dumps(
                        json.loads(call["function"]["arguments"]), separators=(",", ":")
                    ),
                },
            }
            for call in answer.tool_calls
        ]
    return message
