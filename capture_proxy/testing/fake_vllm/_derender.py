"""The fake vLLM's derender route: ``POST /v1/chat/completions/derender``, sans-IO.

vLLM serves it with ``--enable-scale-out``. It turns a generate answer back into a Chat
Completions answer, reasoning and tool calls parsed by the server's parsers. Shapes follow
tests/fixtures/vllm-0.32.0/token-in/ (``derender-*``; docs/upstream-facts.md, "Token-in routes"):

- unary ``{generate_response, prompt_token_ids, chat_request}`` → a ``chat.completion`` whose
  ``id`` is generate's ``request_id``; a parsed tool call's ``id`` is a bare 16-hex string, and
  ``finish_reason`` stays ``"stop"`` with tool calls; ``usage.prompt_tokens`` is 0; the text is
  not cut at a ``stop`` string (generate stopped on it; the chat route cuts);
- streamed ``{stream: true, generate_chunk, stream_state, prompt_token_ids, chat_request}`` (one
  call per generate event; ``stream_state`` is the previous answer's) → ``{chunk, stream_state}``:
  one ``chat.completion.chunk`` for the ids of ``generate_chunk`` (several ids give one merged
  delta; an end-of-turn token alone keeps its text as content), tool call ids
  ``"chatcmpl-tool-..."``,
  ``finish_reason`` ``"tool_calls"`` for any finish once a tool call streamed, the chunk's
  ``token_ids`` when the chat request has ``return_token_ids`` (and does not hide the
  reasoning); the state carries every output id so far (``output_token_ids``,
  ``output_chunk_lens``, ...), the server keeps nothing;
- with a reasoning or tool parser configured (always, for the fake) every call must carry
  ``chat_request`` and ``prompt_token_ids``: 400 with vLLM's messages otherwise.

The parse reuses the fake's generation (`_generation.message_parts`, `stream_deltas`) over the
plan the fake generated those ids from; ids the fake did not generate are parsed as a think block
then content (no tool calls).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._generation import Plan, message_parts, stream_deltas
from ._protocol import logprobs_content, message_body
from ._template import SPECIAL_TOKENS, THINK_END, THINK_START, token_text
from ._validate import RequestError

__all__ = [
    "NEED_CHAT_REQUEST",
    "NEED_PROMPT_IDS",
    "check_derender",
    "derender_body",
    "derender_stream_answer",
    "plan_from_ids",
]

#: vLLM 0.32's 400 messages for a derender call without the chat request or the prompt ids
#: (token-in/experiments.json, ``derender_resend``).
NEED_CHAT_REQUEST = (
    "chat_request is required when a tool or reasoning parser is configured because plain "
    "detokenization would leak raw parser markup into content."
)
NEED_PROMPT_IDS = (
    "prompt_token_ids is required when a tool or reasoning parser is configured. Without it "
    "parse_delta cannot tell whether the prompt left reasoning open (e.g. a chat template that "
    "pre-opens <think>) and would misclassify reasoning content as plain content."
)
_TOOL_PREFIX = "chatcmpl-tool-"
_SPECIAL_IDS = frozenset(SPECIAL_TOKENS.values())
#: The end-of-turn tokens whose text vLLM 0.32's streamed derender keeps when alone in a chunk
#: (the parsers consume the think and tool-call markers).
_TURN_ENDS = frozenset({SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]})
_NEWLINE = ord("\n") + 16

#: Finds the plan the fake generated ``ids`` from (by generate's request id), or None.
PlanLookup = Callable[[str, list[int]], Plan | None]


def check_derender(body: Mapping[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """The prompt ids and chat request of a derender body; vLLM's 400s when either is missing."""
    chat = body.get("chat_request")
    if not isinstance(chat, dict):
        raise RequestError(400, NEED_CHAT_REQUEST, err_type="BadRequestError")
    prompt = body.get("prompt_token_ids")
    if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
        raise RequestError(400, NEED_PROMPT_IDS, err_type="BadRequestError")
    return prompt, chat


def plan_from_ids(ids: list[int]) -> Plan:
    """A parse of ids the fake did not generate: a leading think block, then content."""
    plan = Plan()
    pos = 0
    if ids[:1] == [THINK_START]:
        end = ids.index(THINK_END) if THINK_END in ids else len(ids)
        head = 2 if ids[1:2] == [_NEWLINE] else 1
        body_end = end - 1 if end < len(ids) and ids[end - 1] == _NEWLINE else end
        _extend(plan, ids[:head], "think")
        _extend(plan, ids[head:body_end], "reasoning")
        tail = min(end + 3, len(ids)) if end < len(ids) else end
        _extend(plan, ids[body_end:tail], "think")
        pos = tail
    for token in ids[pos:]:
        _extend(plan, [token], "eos" if token in _SPECIAL_IDS else "content")
    return plan


def _extend(plan: Plan, ids: list[int], kind: str) -> None:
    plan.ids.extend(ids)
    plan.kinds.extend([kind] * len(ids))
    plan.tool_index.extend([-1] * len(ids))


def _without_tools(plan: Plan) -> Plan:
    """The plan as parsed without a tool parser: tool-call text is content."""
    kinds = ["content" if k.startswith("tool") or k == "sep" else k for k in plan.kinds]
    return Plan(list(plan.ids), kinds, [-1] * len(kinds), [], plan.finish_reason)


def _plan(lookup: PlanLookup, request_id: str, ids: list[int], chat: Mapping[str, Any]) -> Plan:
    plan = lookup(request_id, ids) or plan_from_ids(ids)
    if not chat.get("tools") or chat.get("tool_choice") == "none":
        plan = _without_tools(plan)
    return plan


def _output(generate: Mapping[str, Any]) -> tuple[dict[str, Any], list[int]]:
    choices = generate.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RequestError(400, "`generate_response.choices` must hold one choice.")
    ids = choices[0].get("token_ids")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise RequestError(400, "`choices[0].token_ids` must be a list of integers.")
    return choices[0], ids


def _chat_logprobs(choice: Mapping[str, Any]) -> dict[str, Any] | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, Mapping) or not isinstance(lp.get("content"), list):
        return None
    entries = lp["content"]
    ids = [e["token_id"] for e in entries]
    values = [e["logprob"] for e in entries]
    tops = [[(t["token_id"], t["logprob"]) for t in e.get("top_logprobs") or []] for e in entries]
    return {"content": logprobs_content(ids, values, tops, as_token_ids=False)}


def derender_body(
    body: Mapping[str, Any], lookup: PlanLookup, model: str, created: int
) -> dict[str, Any]:
    """The unary derender answer, key for key as ``derender-*-response.json``."""
    _, chat = check_derender(body)
    generate = body.get("generate_response")
    if not isinstance(generate, dict):
        raise RequestError(400, "`generate_response` must be an object.")
    choice, ids = _output(generate)
    request_id = str(generate.get("request_id", ""))
    plan = _plan(lookup, request_id, ids, chat)
    reasoning, content, calls = message_parts(plan, len(ids))
    bare = [
        type(c)(c.id.removeprefix(_TOOL_PREFIX), c.name, c.arguments, c.start, c.header, c.end)
        for c in calls
    ]
    n = len(ids)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": generate.get("created", created),
        "model": generate.get("model", model),
        "choices": [
            {
                "index": 0,
                "message": message_body("reasoning", reasoning, content, bare),
                "logprobs": _chat_logprobs(choice),
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(0, n),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _merge(deltas: list[dict[str, Any] | None], first: bool) -> dict[str, Any]:
    """The deltas of several tokens as one: text joined, tool-call pieces joined per index."""
    content = "".join(d["content"] for d in deltas if d and d.get("content"))
    reasoning = "".join(d["reasoning"] for d in deltas if d and d.get("reasoning"))
    merged: dict[str, Any] = {
        "role": "assistant" if first else None,
        "content": content or None,
        "reasoning": reasoning or None,
    }
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for call in (d or {}).get("tool_calls") or []:
            entry = calls.setdefault(
                call["index"],
                {
                    "id": None,
                    "type": None,
                    "index": call["index"],
                    "function": {"name": None, "arguments": None},
                },
            )
            if "id" in call:
                entry["id"], entry["type"] = call["id"], call["type"]
                entry["function"]["name"] = call["function"]["name"]
            piece = call["function"].get("arguments")
            if piece:
                entry["function"]["arguments"] = (entry["function"]["arguments"] or "") + piece
    if calls:
        merged["tool_calls"] = list(calls.values())
    return merged


def _returns_ids(chat: Mapping[str, Any]) -> bool:
    return chat.get("return_token_ids") is True and chat.get("include_reasoning") is not False


def derender_stream_answer(
    body: Mapping[str, Any], lookup: PlanLookup, model: str, created: int
) -> dict[str, Any]:
    """One streamed derender call's answer, ``{chunk, stream_state}``
    (``derender-*-stream.json``)."""
    _, chat = check_derender(body)
    gen = body.get("generate_chunk")
    if not isinstance(gen, dict):
        raise RequestError(400, "`generate_chunk` must be an object.")
    state = body.get("stream_state") or {}
    if not isinstance(state, dict):
        raise RequestError(400, "`stream_state` must be an object.")
    prev = list(state.get("output_token_ids") or [])
    lens = list(state.get("output_chunk_lens") or [])
    streamed_ids = list(state.get("last_tool_call_ids") or [])
    first = not state.get("role_sent")
    request_id = str(gen.get("request_id", ""))
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": None,
        "system_fingerprint": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "metrics": None,
    }
    choices = gen.get("choices") or []
    if choices:
        choice, new = _output(gen)
        ids = prev + new
        if new:
            lens.append(len(new))
        plan = _plan(lookup, request_id, ids, chat)
        deltas = stream_deltas(plan, len(ids), include_reasoning=True)[len(prev) :]
        delta = _merge(deltas, first)
        if len(new) == 1 and new[0] in _TURN_ENDS:
            # vLLM 0.32 keeps an end-of-turn token's text when it comes in a chunk of its own
            # (DESIGN §11; derender decodes with special tokens kept for its parsers).
            delta["content"] = token_text(new[0])
        for call in delta.get("tool_calls") or []:
            if call["id"] is not None:
                streamed_ids.append(call["id"])
        finish = choice.get("finish_reason")
        named = isinstance(chat.get("tool_choice"), Mapping)
        if finish is not None and streamed_ids and not named:
            # Any finish, "length" too, once a tool call streamed (``_derender_chat_stream_parsed``;
            # the chat route says "tool_calls" only for a "stop").
            finish = "tool_calls"
        chunk["choices"] = [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": choice.get("stop_reason"),
                # vLLM 0.32 returns the chunk's ids when the chat request asks for them and
                # does not hide the reasoning (``_derender_chat_stream_parsed``).
                "token_ids": new if _returns_ids(chat) else None,
            }
        ]
        prev = ids
    usage = gen.get("usage")
    if isinstance(usage, Mapping):
        chunk["usage"] = _usage(int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
    stream_state = {
        "prev_tokens": [],
        "prefix_offset": 0,
        "read_offset": 0,
        "role_sent": True,
        "logprob_context_token_ids": [],
        "logprob_text_offset": 0,
        "output_token_ids": prev,
        "output_chunk_lens": lens,
        "tools_streamed": bool(streamed_ids),
        "last_tool_call_ids": streamed_ids,
    }
    return {"chunk": chunk, "stream_state": stream_state}
