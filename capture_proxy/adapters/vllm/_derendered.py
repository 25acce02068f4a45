"""A token-in call's answer as the client gets it: derender's Chat Completions answer, shaped by
the relay rules of the chat route (sans-IO).

Derender (``POST /v1/chat/completions/derender``) builds a ``chat.completion`` (or, streamed, one
``chat.completion.chunk`` per call) from generate's ids, reasoning and tool calls parsed by vLLM's
own parsers. Its answer differs from the chat route's in what it cannot know; the client gets
what the chat route would have sent:

- ``usage`` is generate's (derender counts no prompt: its ``prompt_tokens`` is 0);
- a unary answer with tool calls has ``finish_reason`` ``"tool_calls"`` (derender's unary answer
  keeps generate's ``"stop"``; its streamed chunks already say ``"tool_calls"``);
- the rules of `capture_proxy.adapters.vllm`'s module docs: ``prompt_token_ids``,
  ``prompt_text`` and ``token_ids`` only when the client sent ``return_token_ids: true`` (then
  the ids the call sent and generated), ``logprobs`` null unless the client sent ``logprobs:
  true``, ``routed_experts`` removed, the null ``prompt_logprobs`` / transfer params removed, the
  usage-only chunk of a stream only when the client asked for usage.

`DerenderedStream` also puts the streamed message together (content, reasoning, tool calls) for
the record, as `to_completion` reads it from a unary answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from ._token_in import Generated
from ._wire import NULL_DROPPED_FIELDS, TOKEN_ID_FIELDS, ClientWants

__all__ = ["DerenderedStream", "client_answer"]


def _usage(generated: Generated, prompt_len: int) -> dict[str, int]:
    if generated.usage is not None:
        return dict(generated.usage)
    n = len(generated.completion_ids)
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


def _top(answer: Mapping[str, Any], wants: ClientWants) -> dict[str, Any]:
    """The top level without the fields the client did not ask for."""
    return {
        k: v
        for k, v in answer.items()
        if not (k in TOKEN_ID_FIELDS and not wants.token_ids)
        and not (k in NULL_DROPPED_FIELDS and v is None)
    }


def _choice(choice: Mapping[str, Any], wants: ClientWants) -> dict[str, Any]:
    out = {k: v for k, v in choice.items() if k != "routed_experts"}
    if not wants.token_ids:
        out.pop("token_ids", None)
    if not wants.logprobs and out.get("logprobs") is not None:
        out["logprobs"] = None
    return out


def client_answer(
    derendered: Mapping[str, Any],
    generated: Generated,
    prompt_ids: Sequence[int],
    wants: ClientWants,
) -> bytes:
    """The unary answer for the client (JSON) from derender's `derendered` answer, the
    `generated` completion and the `prompt_ids` sent (module docs for what changes)."""
    body = _top(derendered, wants)
    choices = []
    for choice in derendered.get("choices") or ():
        c = _choice(choice, wants)
        message = c.get("message") or {}
        if message.get("tool_calls") and c.get("finish_reason") == "stop":
            c["finish_reason"] = "tool_calls"
        if wants.token_ids:
            c["token_ids"] = list(generated.completion_ids)
        choices.append(c)
    body["choices"] = choices
    if wants.token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    body["usage"] = _usage(generated, len(prompt_ids))
    return orjson.dumps(body)


class DerenderedStream:
    """Shapes a streamed token-in answer's chunks for the client and puts its message together.

    `feed` each derendered ``chat.completion.chunk`` (decoded) in order; it returns the SSE
    event to send (``data: ...``), or None for a chunk the client does not get. `message` is the
    assistant message so far, in the shape `to_completion` reads (``content``, ``reasoning``,
    ``tool_calls``).
    """

    def __init__(self, wants: ClientWants, prompt_ids: Sequence[int]) -> None:
        self._wants = wants
        self._prompt_ids = prompt_ids
        self._first = True
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tools: dict[int, dict[str, Any]] = {}

    def feed(self, chunk: Mapping[str, Any]) -> bytes | None:
        choices = chunk.get("choices") or []
        for choice in choices:
            self._take(choice.get("delta") or {})
        usage = chunk.get("usage")
        if not choices and usage is not None and not self._wants.usage:
            return None  # the usage-only chunk the proxy asked for, not the client
        out = _top(chunk, self._wants)
        out["choices"] = [_choice(c, self._wants) for c in choices]
        if not self._wants.usage:
            out.pop("usage", None)
        elif usage is not None:
            # The prompt the call sent, whatever derender counted.
            n = int(usage.get("completion_tokens") or 0)
            prompt = len(self._prompt_ids)
            out["usage"] = {**usage, "prompt_tokens": prompt, "total_tokens": prompt + n}
        if self._first and self._wants.token_ids:
            out["prompt_token_ids"] = list(self._prompt_ids)
        self._first = False
        return b"data: " + orjson.dumps(out) + b"\n\n"

    def _take(self, delta: Mapping[str, Any]) -> None:
        if delta.get("content"):
            self._content.append(delta["content"])
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            self._reasoning.append(reasoning)
        for tc in delta.get("tool_calls") or ():
            slot = self._tools.setdefault(
                int(tc.get("index") or 0),
                {"id": None, "type": None, "function": {"name": "", "arguments": ""}},
            )
            slot["id"] = slot["id"] or tc.get("id")
            slot["type"] = slot["type"] or tc.get("type")
            fn = tc.get("function") or {}
            slot["function"]["name"] += fn.get("name") or ""
            slot["function"]["arguments"] += fn.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        """The assistant message streamed so far (``content``, ``reasoning``, ``tool_calls``)."""
        return {
            "role": "assistant",
            "content": "".join(self._content) or None,
            "reasoning": "".join(self._reasoning) or None,
            "tool_calls": [self._tools[i] for i in sorted(self._tools)],
        }
