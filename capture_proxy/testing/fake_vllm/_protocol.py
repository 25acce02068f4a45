"""vLLM 0.32's OpenAI wire shapes, built as dicts with the key order vLLM sends.

Every shape here is checked against ``fixtures/vllm-0.32.0`` by ``tests/testing/test_fake_vllm.py``.
vLLM serializes with pydantic (compact JSON, UTF-8, shortest float repr); ``orjson`` writes the
same bytes. Streamed chunks are dumped with ``exclude_unset``, so a field vLLM sets to None
explicitly (``token_ids`` when not asked for, ``prompt_text``) is sent as ``null`` and fields it
never sets are absent; the trailing usage chunk also excludes None.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import orjson

from ._generation import PlannedCall
from ._template import decode, token_text

__all__ = [
    "DONE",
    "ChunkWriter",
    "error_body",
    "logprobs_content",
    "message_body",
    "model_list",
    "reasoning_output_key",
    "sse",
    "stream_error_event",
    "usage_body",
]

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON (vLLM's separator is a blank line)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def stream_error_event(message: str, code: int) -> bytes:
    """The event vLLM sends when generation fails mid-stream (``json.dumps``, so with spaces)."""
    err_type = "InternalServerError" if code >= 500 else "BadRequestError"
    return b"data: " + json.dumps(error_body(message, err_type, code)).encode() + b"\n\n"


def reasoning_output_key(version: str) -> str:
    """``reasoning`` from vLLM 0.16 on; ``reasoning_content`` before."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return "reasoning"
    return "reasoning_content" if (major, minor) < (0, 16) else "reasoning"


#: How many sampled ids before a token vLLM reads to finish a character split across tokens.
_CONTEXT = 4


def decoded_token(token_id: int, context: Sequence[int]) -> str:
    """A logprob entry's token string as vLLM 0.32 resolves it (its engine for the chat route,
    its derender alike): the token's text, or, when that ends in a partial character (U+FFFD),
    what the token adds to the text of the up to four ids sampled before it (`context`), read
    with the fewest of them that complete the character; ``""`` when none do (the character
    is finished by a later token, whose string then holds it whole)."""
    text = token_text(token_id)
    if not text.endswith("\ufffd"):
        return text
    for n in range(1, min(len(context), _CONTEXT) + 1):
        before = list(context[len(context) - n :])
        whole = decode([*before, token_id])
        if whole.endswith("\ufffd"):
            continue
        # The context's own trailing partial characters are part of what this token finishes.
        clean = len(before)
        while clean > 0 and token_text(before[clean - 1]).endswith("\ufffd"):
            clean -= 1
        prefix = decode(before[:clean])
        if whole.startswith(prefix):
            return whole[len(prefix) :]
        same = 0
        for a, b in zip(prefix, whole, strict=False):
            if a != b:
                break
            same += 1
        return whole[same:]
    return ""


def logprobs_content(
    ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[Sequence[tuple[int, float]]],
    *,
    as_token_ids: bool,
    context: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """``logprobs.content`` entries: ``{token, logprob, bytes, top_logprobs}`` per token.

    ``token`` is the resolved string (`decoded_token`, the ids sampled before it as context:
    `context` then the earlier `ids`), ``"token_id:N"`` with ``return_tokens_as_token_ids``;
    ``bytes`` the UTF-8 of the resolved string either way (a character split across tokens:
    empty, then the whole character). Top entries have no nested list and, as in vLLM, their
    ``bytes`` are the UTF-8 of their ``token`` string, ``"token_id:N"`` included.
    """
    out: list[dict[str, Any]] = []
    seen = list(context)
    for token_id, lp, top in zip(ids, logprobs, tops, strict=True):
        top_entries = []
        for alt, alt_lp in top:
            alt_text = f"token_id:{alt}" if as_token_ids else decoded_token(alt, seen)
            top_entries.append(
                {"token": alt_text, "logprob": alt_lp, "bytes": list(alt_text.encode())}
            )
        text = decoded_token(token_id, seen)
        out.append(
            {
                "token": f"token_id:{token_id}" if as_token_ids else text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": top_entries,
            }
        )
        seen.append(token_id)
    return out


def message_body(
    reasoning_key: str, reasoning: str | None, content: str | None, calls: Sequence[PlannedCall]
) -> dict[str, Any]:
    """A non-streaming ``choices[0].message``; ``tool_calls`` is present only when there are any."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    message[reasoning_key] = reasoning
    return message


def usage_body(prompt: int, completion: int, reasoning: int, *, stream: bool) -> dict[str, Any]:
    """``usage``; the streamed one omits the null ``prompt_tokens_details``."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if not stream:
        usage["prompt_tokens_details"] = None
    usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


class ChunkWriter:
    """Builds the ``chat.completion.chunk`` events of one stream."""

    def __init__(self, call_id: str, created: int, model: str) -> None:
        self._head = {
            "id": call_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

    def first(
        self,
        prompt_token_ids: list[int] | None,
        prompt_text: str | None,
        usage: dict[str, Any] | None = None,
    ) -> bytes:
        """The role chunk: ``delta {role, content: ""}``, the prompt ids when asked for, its
        `usage` with ``continuous_usage_stats``."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if usage is not None:
            chunk["usage"] = usage
        chunk["prompt_token_ids"] = prompt_token_ids
        chunk["prompt_text"] = prompt_text
        return sse(chunk)

    def token(
        self,
        delta: dict[str, Any],
        logprobs: list[dict[str, Any]] | None,
        token_ids: list[int] | None,
        *,
        finish_reason: str | None = None,
        fingerprint: str | None = None,
        routed_experts: str | None = None,
        stop_reason: str | int | None = None,
        usage: dict[str, Any] | None = None,
    ) -> bytes:
        """One generated token's chunk; the last carries ``finish_reason`` and ``stop_reason``
        (and ``routed_experts`` when the fake returns them); `usage` with
        ``continuous_usage_stats`` (the counts through this chunk)."""
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = token_ids
        if routed_experts is not None:
            choice["routed_experts"] = routed_experts
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if usage is not None:
            chunk["usage"] = usage
        if fingerprint is not None:
            chunk["system_fingerprint"] = fingerprint
        return sse(chunk)

    def usage(self, usage: dict[str, Any], fingerprint: str) -> bytes:
        """The final chunk with empty ``choices`` (only with ``stream_options.include_usage``)."""
        return sse({**self._head, "choices": [], "usage": usage, "system_fingerprint": fingerprint})


def model_list(model: str, created: int, max_model_len: int, perm_id: str) -> dict[str, Any]:
    """``GET /v1/models`` (``root`` is the model name; vLLM shows the weights' path there)."""
    permission = {
        "id": perm_id,
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}
