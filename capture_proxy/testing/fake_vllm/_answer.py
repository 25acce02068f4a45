"""One generated answer as vLLM 0.32 sends it: a non-streaming body or the stream's events.

Sans-IO: `Answer` holds what was generated and what the request asked for; `completion_body`
returns the JSON body, `stream_events` the ``data:`` events (``[DONE]`` included). The HTTP side
(`fake_vllm`) writes them and injects faults between them.

vLLM behaviours reproduced on purpose, because capture has to survive them:

- ``include_reasoning: false`` hides reasoning *and* the completion's token ids and logprobs
  (null), while ``prompt_token_ids`` are still sent;
- a streamed token whose delta is empty (a ``<think>`` marker, the tool-call syntax, the final
  ``<|im_end|>``) is sent as ``delta: {}`` only when token ids or logprobs were asked for, and is
  otherwise not sent at all;
- the finish chunk carries ``system_fingerprint`` only when no usage chunk follows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ._experts import encode_experts, experts_for
from ._faults import FaultKind
from ._generation import (
    Plan,
    PlannedCall,
    Turn,
    cut_at_stop,
    message_parts,
    plan_answer,
    prompt_ends_reasoning,
    reasoning_token_count,
    sample_logprobs,
    stop_on_strings,
    stream_deltas,
)
from ._protocol import (
    DONE,
    ChunkWriter,
    logprobs_content,
    message_body,
    reasoning_output_key,
    usage_body,
)

__all__ = ["Answer", "answer_for", "completion_body", "stream_events"]


@dataclass
class Answer:
    """Everything needed to write one answer; ``n`` is how many of ``plan.ids`` were generated."""

    call_id: str
    created: int
    model: str
    fingerprint: str
    reasoning_key: str
    prompt_ids: list[int]
    prompt_text: str | None
    plan: Plan
    n: int
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]
    want_logprobs: bool = False
    want_token_ids: bool = False
    as_token_ids: bool = False
    include_reasoning: bool = True
    include_usage: bool = False
    #: ``stream_options.continuous_usage_stats`` (with ``include_usage``): usage on every chunk.
    continuous_usage: bool = False
    include_stop_str: bool = False
    #: Not ``enable_thinking: false`` (the reasoning count starts open, whatever the prompt).
    thinking: bool = True
    drop_all_ids: bool = False
    drop_every: int | None = None
    extra_usage: int = 0
    stream: bool = False
    fault: str | None = None
    #: ``routed_experts`` (base64 ``.npy``) when the fake returns them, else None.
    experts: str | None = None

    @property
    def ids(self) -> list[int]:
        return self.plan.ids[: self.n]

    def record(self) -> dict[str, Any]:
        """What was generated, for `FakeVLLM.responses` (before any fault touched it)."""
        return {
            "id": self.call_id,
            "stream": self.stream,
            "prompt_token_ids": list(self.prompt_ids),
            "completion_token_ids": list(self.ids),
            "logprobs": self.logprobs[: self.n],
            "finish_reason": self.plan.finish(self.n),
            "fault": self.fault,
        }

    def _running_usage(self, n: int) -> dict[str, Any] | None:
        """A chunk's usage with ``continuous_usage_stats``: the counts through its first `n`
        tokens (the last chunk's are the usage chunk's); None without it."""
        if not self.continuous_usage:
            return None
        if n >= len(self.ids) and n:
            return self._usage(stream=True)
        reasoning = reasoning_token_count(self.ids[:n], thinking=self.thinking)
        return usage_body(len(self.prompt_ids), n, reasoning, stream=True)

    def _usage(self, *, stream: bool) -> dict[str, Any]:
        ids = self.ids
        return usage_body(
            len(self.prompt_ids),
            len(ids) + self.extra_usage,
            reasoning_token_count(
                ids,
                thinking=self.thinking,
                ended=self.plan.finish(self.n) in ("stop", "tool_calls")
                and self.plan.stop_reason is None
                and self.n == len(self.plan.ids),
            ),
            stream=stream,
        )

    def _prompt_ids_out(self) -> list[int] | None:
        return self.prompt_ids if self.want_token_ids and not self.drop_all_ids else None

    def _dropped(self, k: int) -> bool:
        return self.drop_every is not None and (k + 1) % self.drop_every == 0


def answer_for(
    body: Mapping[str, Any],
    turn: Turn,
    *,
    prompt_ids: list[int],
    prompt_text: str,
    limit: int,
    model: str,
    fingerprint: str,
    version: str,
    seed: int,
    new_id: Callable[[str], str],
    routed_experts: bool = False,
) -> Answer:
    """Generate ``turn`` (at most ``limit`` tokens) as the request ``body`` asks for it.

    With `routed_experts` (a server started with ``--enable-return-routed-experts``), the answer
    carries the experts of the prompt and output positions from the request's
    ``routed_experts_prompt_start`` (default 0) on (`_experts`).
    """
    kwargs = body.get("chat_template_kwargs")
    thinking = not (isinstance(kwargs, Mapping) and kwargs.get("enable_thinking") is False)
    plan = plan_answer(
        turn,
        # The model opens no reasoning after a prompt that ended it (a continued message).
        thinking=not prompt_ends_reasoning(prompt_ids, thinking=thinking),
        parse_tools=bool(body.get("tools")) and body.get("tool_choice") != "none",
        new_tool_id=lambda: new_id("chatcmpl-tool-"),
    )
    if isinstance(body.get("tool_choice"), Mapping) and plan.finish_reason is None:
        # vLLM 0.32's chat route: "tool_calls" for auto or required tool calls, "stop" for a
        # named one (unary and streamed).
        plan.finish_reason = "stop"
    stop_on_strings(plan, body.get("stop"), body.get("min_tokens"), limit)
    n = min(len(plan.ids), limit)
    want_logprobs = bool(body.get("logprobs"))
    top = body.get("top_logprobs")
    top_k = top if want_logprobs and type(top) is int and top > 0 else 0
    logprobs, tops = sample_logprobs(seed, prompt_ids, plan.ids[:n], top_k)
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    fault = turn.fault
    kind = fault.kind if fault is not None else None
    experts = None
    if routed_experts:
        start = body.get("routed_experts_prompt_start")
        start = start if type(start) is int else 0
        experts = encode_experts(experts_for([*prompt_ids, *plan.ids[:n]], start))
    return Answer(
        call_id=new_id("chatcmpl-"),
        created=int(time.time()),
        model=model,
        fingerprint=fingerprint,
        reasoning_key=reasoning_output_key(version),
        prompt_ids=prompt_ids,
        prompt_text=prompt_text if body.get("return_prompt_text") else None,
        plan=plan,
        n=n,
        logprobs=logprobs,
        tops=tops,
        want_logprobs=want_logprobs,
        want_token_ids=bool(body.get("return_token_ids")),
        as_token_ids=bool(body.get("return_tokens_as_token_ids")),
        include_reasoning=body.get("include_reasoning", True) is not False,
        include_usage=stream
        and isinstance(options, Mapping)
        and bool(options.get("include_usage")),
        continuous_usage=stream
        and isinstance(options, Mapping)
        and bool(options.get("include_usage"))
        and bool(options.get("continuous_usage_stats")),
        drop_all_ids=kind is FaultKind.DROP_TOKEN_IDS and fault is not None and fault.every is None,
        drop_every=fault.every if kind is FaultKind.DROP_TOKEN_IDS and fault is not None else None,
        extra_usage=1 if kind is FaultKind.USAGE_MISMATCH else 0,
        include_stop_str=body.get("include_stop_str_in_output") is True,
        thinking=thinking,
        stream=stream,
        fault=kind.value if kind is not None else None,
        experts=experts,
    )


def _cut(
    a: Answer, reasoning: str | None, content: str | None, calls: list[PlannedCall]
) -> tuple[str | None, str | None, list[PlannedCall]]:
    """The chat route's cut at the stop string generation stopped on: content, else reasoning
    (vLLM's detokenizer cuts the whole text; the parsers split what is left)."""
    stop = a.plan.stop_reason
    if stop is None or a.n < len(a.plan.ids):
        return reasoning, content, calls
    cut = cut_at_stop(content, stop, a.include_stop_str)
    if cut is not None:
        return reasoning, cut or None, calls
    cut = cut_at_stop(reasoning, stop, a.include_stop_str)
    return (cut or None) if cut is not None else reasoning, content, calls


def _cap_deltas(a: Answer, deltas: list[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """Stream deltas whose text adds up to the cut answer (`_cut`). A stop string in the last
    tool call's arguments cuts them there (vLLM cuts the text its tool parser reads)."""
    reasoning, content, _ = message_parts(a.plan, a.n)
    cut_reasoning, cut_content, _ = _cut(a, reasoning, content, [])
    room = {"content": len(cut_content or ""), "reasoning": len(cut_reasoning or "")}
    args_room = _tool_args_room(a, deltas)
    out: list[dict[str, Any] | None] = []
    for delta in deltas:
        if delta is not None:
            delta = dict(delta)
            for key in room:
                piece = delta.get(key)
                if isinstance(piece, str):
                    delta[key] = piece[: room[key]] or None
                    room[key] -= len(delta[key] or "")
            if args_room is not None and delta.get("tool_calls"):
                delta["tool_calls"] = [_cap_args(c, args_room) for c in delta["tool_calls"]]
        out.append(delta)
    return out


def _tool_args_room(a: Answer, deltas: list[dict[str, Any] | None]) -> dict[int, int] | None:
    """How many characters of the last streamed tool call's arguments the chat route streams
    when generation stopped on a stop string inside them (not in the streamed content or
    reasoning); None when nothing is cut there."""
    stop = a.plan.stop_reason
    if stop is None or a.n < len(a.plan.ids):
        return None
    for key in ("content", "reasoning"):
        text = "".join((d or {}).get(key) or "" for d in deltas)
        if cut_at_stop(text, stop, a.include_stop_str) is not None:
            return None
    args: dict[int, str] = {}
    for delta in deltas:
        for call in (delta or {}).get("tool_calls") or ():
            index = int(call.get("index") or 0)
            args[index] = args.get(index, "") + (
                (call.get("function") or {}).get("arguments") or ""
            )
    if not args:
        return None
    last = max(args)
    cut = cut_at_stop(args[last], stop, a.include_stop_str)
    return None if cut is None else {last: len(cut)}


def _cap_args(call: dict[str, Any], room: dict[int, int]) -> dict[str, Any]:
    index = int(call.get("index") or 0)
    fn = call.get("function")
    if index not in room or not isinstance(fn, dict) or not fn.get("arguments"):
        return call
    piece = fn["arguments"][: room[index]]
    room[index] -= len(piece)
    return {**call, "function": {**fn, "arguments": piece}}


def completion_body(a: Answer) -> dict[str, Any]:
    """The ``chat.completion`` body, key for key in the order of ``chat-response.json``."""
    ids = a.ids
    reasoning, content, calls = _cut(a, *message_parts(a.plan, a.n))
    hidden = not a.include_reasoning
    lp: list[dict[str, Any]] | None = None
    if a.want_logprobs and not hidden:
        lp = logprobs_content(ids, a.logprobs[: a.n], a.tops[: a.n], as_token_ids=a.as_token_ids)
    token_ids: list[int] | None = list(ids) if a.want_token_ids and not hidden else None
    if a.drop_every is not None:
        keep = [k for k in range(len(ids)) if not a._dropped(k)]
        token_ids = None if token_ids is None else [ids[k] for k in keep]
        lp = None if lp is None else [lp[k] for k in keep]
    if a.drop_all_ids:
        token_ids = None
    choice = {
        "index": 0,
        "message": message_body(a.reasoning_key, None if hidden else reasoning, content, calls),
        "logprobs": None if lp is None else {"content": lp},
        "finish_reason": a.plan.finish(a.n),
        "stop_reason": a.plan.stop_reason_at(a.n),
        "token_ids": token_ids,
        "routed_experts": a.experts,
    }
    return {
        "id": a.call_id,
        "object": "chat.completion",
        "created": a.created,
        "model": a.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": a.fingerprint,
        "usage": a._usage(stream=False),
        "prompt_logprobs": None,
        "prompt_token_ids": a._prompt_ids_out(),
        "prompt_text": a.prompt_text,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def stream_events(a: Answer) -> Iterator[bytes]:
    """The stream's events: role chunk, one chunk per token, usage (if asked), ``[DONE]``."""
    writer = ChunkWriter(a.call_id, a.created, a.model)
    yield writer.first(a._prompt_ids_out(), a.prompt_text, a._running_usage(0))
    hidden = not a.include_reasoning
    ids = a.ids
    deltas = _cap_deltas(a, stream_deltas(a.plan, a.n, include_reasoning=a.include_reasoning))
    finish = a.plan.finish(a.n)
    streamed_call = any((d or {}).get("tool_calls") for d in deltas)
    if finish == "stop" and streamed_call and a.plan.finish_reason is None:
        # vLLM's chat route: a stream whose tool call streamed and that stopped says
        # "tool_calls" (a stop string inside the arguments too), but for a named tool choice.
        finish = "tool_calls"
    send_ids = a.want_token_ids and not hidden and not a.drop_all_ids
    fingerprint = None if a.include_usage else a.fingerprint
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        lp = None
        if a.want_logprobs and not hidden:
            lp = logprobs_content(
                [token],
                [a.logprobs[k]],
                [a.tops[k]],
                as_token_ids=a.as_token_ids,
                context=ids[max(0, k - 4) : k],
            )
        delta = deltas[k]
        if delta is None:
            if not last and lp is None and (not a.want_token_ids or hidden):
                continue
            delta = {}
        if a._dropped(k) and not last:
            continue
        yield writer.token(
            delta,
            lp,
            [token] if send_ids else None,
            finish_reason=finish if last else None,
            stop_reason=a.plan.stop_reason_at(a.n) if last else None,
            fingerprint=fingerprint if last else None,
            routed_experts=a.experts if last else None,
            usage=a._running_usage(k + 1),
        )
    if not ids:
        yield writer.token(
            {},
            None,
            [] if send_ids else None,
            finish_reason=finish,
            fingerprint=fingerprint,
            routed_experts=a.experts,
            usage=a._running_usage(0),
        )
    if a.include_usage:
        yield writer.usage(a._usage(stream=True), a.fingerprint)
    yield DONE
