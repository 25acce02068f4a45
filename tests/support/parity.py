"""What the agent gets from one chat call, read the same way through the plain path and token-in.

`agent_view` posts a Chat Completions body through a proxy and returns, for a unary call, the
answer without what differs per call (ids, timestamps, the fingerprint), and for a streamed one
the answer put together from its chunks (message, finish reason, logprobs, usage). A tool call's
id is random per call: it is kept as its form (`id_form`: ``chatcmpl-tool-<16 hex>``), unary and
streamed, where every chunk that carries one is counted. Both token-in
parity suites (against the fake, tests/server/test_token_in_parity.py, and the real vLLM,
tests/e2e/test_vllm_parity.py) compare these field by field.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson

__all__ = ["Post", "agent_view", "id_form", "strip_volatile"]

#: Posts a body, gives the response.
Post = Callable[[Mapping[str, Any]], Awaitable[aiohttp.ClientResponse]]

_VOLATILE = frozenset({"id", "created", "system_fingerprint"})


_RANDOM_TAIL = re.compile(r"[0-9a-f]{8,}$")


def id_form(value: Any) -> Any:
    """A random id's form: its random hex tail as its length (``chatcmpl-tool-<16 hex>``)."""
    if not isinstance(value, str):
        return value
    return _RANDOM_TAIL.sub(lambda m: f"<{len(m.group())} hex>", value)


def strip_volatile(value: Any, *, key: str = "") -> Any:
    """`value` without the fields that differ per call (ids, timestamps, fingerprint); a tool
    call's id (in ``tool_calls``) as its form (`id_form`)."""
    if isinstance(value, dict):
        return {
            k: id_form(v) if k == "id" and key == "tool_calls" else strip_volatile(v, key=k)
            for k, v in value.items()
            if k not in _VOLATILE or (k == "id" and key == "tool_calls")
        }
    if isinstance(value, list):
        return [strip_volatile(v, key=key) for v in value]
    return value


async def agent_view(post: Post, body: Mapping[str, Any]) -> dict[str, Any]:
    resp = await post(body)
    assert resp.status == 200, await resp.text()
    if not body.get("stream"):
        answer: dict[str, Any] = await resp.json()
        return strip_volatile(answer)  # type: ignore[no-any-return]
    content, reasoning, finish, usage = "", "", None, None
    #: Whether every chunk carried usage (``continuous_usage_stats``), and its completion counts.
    every_chunk_usage, counted = True, []
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
        every_chunk_usage = every_chunk_usage and chunk.get("usage") is not None
        if chunk.get("usage") is not None:
            running = chunk["usage"]
            assert (
                running["total_tokens"] == running["prompt_tokens"] + running["completion_tokens"]
            )
            details = running.get("completion_tokens_details") or {}
            assert details.get("reasoning_tokens", 0) <= running["completion_tokens"]
            counted.append(running["completion_tokens"])
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or ():
                slot = calls.setdefault(tc["index"], {"ids": [], "name": "", "arguments": ""})
                if tc.get("id") is not None:
                    slot["ids"].append(id_form(tc["id"]))
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
        "usage_in_every_chunk": every_chunk_usage,
        # Chunks fall differently through token-in (coalesced): a running count only grows.
        "usage_counts_grow": counted == sorted(counted),
    }
