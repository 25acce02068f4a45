"""What the agent gets from one chat call, read the same way through the plain path and token-in.

`agent_view` posts a Chat Completions body through a proxy and returns, for a unary call, the
answer without what differs per call (ids, timestamps, the fingerprint), and for a streamed one
the answer put together from its chunks (message, finish reason, logprobs, usage). Both token-in
parity suites (against the fake, tests/server/test_token_in_parity.py, and the real vLLM,
tests/e2e/test_vllm_parity.py) compare these field by field.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson

__all__ = ["Post", "agent_view", "strip_volatile"]

#: Posts a body, gives the response.
Post = Callable[[Mapping[str, Any]], Awaitable[aiohttp.ClientResponse]]

_VOLATILE = frozenset({"id", "created", "system_fingerprint"})


def strip_volatile(value: Any) -> Any:
    """`value` without the fields that differ per call (ids, timestamps, fingerprint)."""
    if isinstance(value, dict):
        return {k: strip_volatile(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [strip_volatile(v) for v in value]
    return value


async def agent_view(post: Post, body: Mapping[str, Any]) -> dict[str, Any]:
    resp = await post(body)
    assert resp.status == 200, await resp.text()
    if not body.get("stream"):
        answer: dict[str, Any] = await resp.json()
        return strip_volatile(answer)  # type: ignore[no-any-return]
    content, reasoning, finish, usage = "", "", None, None
    logprobs: list[Any] = []
    calls: dict[int, dict[str, Any]] = {}
    stop_reason: Any = None
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        chunk = orjson.loads(line[6:])
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or ():
                slot = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            logprobs += (choice.get("logprobs") or {}).get("content") or ()
            if choice.get("finish_reason") is not None:
                finish = choice["finish_reason"]
                stop_reason = choice.get("stop_reason")
    return {
        "content": content,
        "reasoning": reasoning,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "logprobs": logprobs,
        "usage": usage,
    }
