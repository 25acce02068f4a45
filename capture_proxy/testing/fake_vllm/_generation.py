"""What the fake vLLM "generates": scripted turns turned into token ids, logprobs and deltas.

A `Turn` becomes exactly the text a faithful replay of the answer renders after the generation
prompt (see `_template`)::

    <think>\\n{reasoning}\\n</think>\\n\\n{content}
    [\\n]<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>   (per tool call)
    <|im_end|>

so replaying the answer unchanged makes the next prompt extend this prompt + completion exactly.
Tool arguments are generated as ``json.dumps(arguments, ensure_ascii=False)``
(``{"command": "ls"}``, spaces included, as vLLM's hermes parser returns them).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import random
import struct
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._faults import Fault
from ._template import (
    BYTE_OFFSET,
    SPECIAL_TOKENS,
    THINK_END,
    THINK_START,
    decode,
    encode,
    token_bytes,
    tool_call_text,
)

__all__ = [
    "FakeToolCall",
    "Plan",
    "PlannedCall",
    "Turn",
    "cut_at_stop",
    "default_turn",
    "message_parts",
    "plan_answer",
    "prompt_ends_reasoning",
    "reasoning_token_count",
    "sample_logprobs",
    "stop_on_strings",
    "stream_deltas",
]

_POST_REASONING = frozenset({"content", "sep", "tool_head", "tool_args", "tool_tail"})


@dataclass
class FakeToolCall:
    """A tool call the scripted model makes: generated as a hermes ``<tool_call>`` block."""

    name: str
    arguments: dict[str, Any]


@dataclass
class Turn:
    """One scripted answer.

    ``finish_reason`` defaults to ``"tool_calls"`` with tool calls, ``"length"`` when
    ``max_tokens`` cuts the answer, else ``"stop"``. An explicit reason is sent as given (unless
    ``max_tokens`` cuts the answer); one other than stop/tool_calls generates no end-of-turn token.
    ``stop_token`` is the end-of-sequence token a finished answer ends with: the tokenizer's
    ``<|im_end|>``, or ``<|endoftext|>``, the model's other one (Qwen3's generation config
    lists both: vLLM stops on it as on a ``stop_token_ids`` id, and says ``stop_reason: 0``).
    """

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[FakeToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    fault: Fault | None = None
    stop_token: str = "<|im_end|>"


@dataclass(frozen=True)
class PlannedCall:
    """A tool call's id, text and token positions (start, header chunk, end exclusive)."""

    id: str
    name: str
    arguments: str
    start: int
    header: int
    end: int


@dataclass
class Plan:
    """The full answer as tokens: id, kind and tool index per position, and the tool calls."""

    ids: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    tool_index: list[int] = field(default_factory=list)
    calls: list[PlannedCall] = field(default_factory=list)
    finish_reason: str | None = None
    #: The ``stop`` string generation stopped on (vLLM's ``stop_reason``), None otherwise.
    stop_reason: str | None = None
    #: The id of the end-of-sequence token other than the tokenizer's the answer ends with
    #: (`Turn.stop_token`), None otherwise.
    stop_token: int | None = None

    def add(self, kind: str, text: str, tool: int = -1) -> None:
        ids = encode(text)
        self.ids.extend(ids)
        self.kinds.extend([kind] * len(ids))
        self.tool_index.extend([tool] * len(ids))

    def finish(self, n: int) -> str:
        """The finish reason when the first ``n`` tokens were generated."""
        if n < len(self.ids):
            return "length"
        if self.stop_reason is not None:
            return "stop"
        if self.finish_reason:
            return self.finish_reason
        return "tool_calls" if self.calls else "stop"

    def stop_reason_at(self, n: int) -> str | int | None:
        """vLLM's ``stop_reason`` when the first ``n`` tokens were generated: the stop string,
        or the id of the model's other end-of-sequence token, once the answer is whole."""
        if n < len(self.ids):
            return None
        return self.stop_reason if self.stop_reason is not None else self.stop_token


def plan_answer(
    turn: Turn, *, thinking: bool, parse_tools: bool, new_tool_id: Callable[[], str]
) -> Plan:
    """Tokens of ``turn``; with ``parse_tools`` false its tool calls stay plain content text."""
    plan = Plan(finish_reason=turn.finish_reason)
    if thinking and turn.reasoning:
        plan.add("think", "<think>\n")
        plan.add("reasoning", turn.reasoning)
        plan.add("think", "\n</think>\n\n")
    plan.add("content", turn.content)
    for i, call in enumerate(turn.tool_calls):
        args = json.dumps(call.arguments, ensure_ascii=False)
        if i or turn.content:
            plan.add("sep" if parse_tools else "content", "\n")
        if not parse_tools:
            plan.add("content", tool_call_text(call.name, args))
            continue
        start = len(plan.ids)
        plan.add(
            "tool_head", f'<tool_call>\n{{"name": {json.dumps(call.name, ensure_ascii=False)},', i
        )
        header = len(plan.ids) - 1
        plan.add("tool_head", ' "arguments": ', i)
        plan.add("tool_args", args, i)
        plan.add("tool_tail", "}\n</tool_call>", i)
        plan.calls.append(PlannedCall(new_tool_id(), call.name, args, start, header, len(plan.ids)))
    if turn.finish_reason in (None, "stop", "tool_calls"):
        if turn.stop_token not in _END_TOKENS:
            raise ValueError(f"stop_token must be one of {_END_TOKENS}, not {turn.stop_token!r}")
        plan.add("eos", turn.stop_token)
        if turn.stop_token != "<|im_end|>":
            plan.stop_token = SPECIAL_TOKENS[turn.stop_token]
    return plan


#: The end-of-sequence tokens a scripted answer may end with (`Turn.stop_token`).
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def stop_on_strings(plan: Plan, stops: Any, min_tokens: Any, limit: int) -> None:
    """End `plan` at the first of its first `limit` tokens whose text completes a ``stop``
    string (checked once more than ``min_tokens`` tokens are out), as vLLM's engine stops:
    the ids end with that token, no end-of-turn token follows, ``stop_reason`` names the string.
    The text is not cut here: the chat route cuts it (`cut_at_stop`), derender does not."""
    wanted = [stops] if isinstance(stops, str) else [s for s in stops or () if isinstance(s, str)]
    wanted = [s for s in wanted if s]
    if not wanted:
        return
    floor = min_tokens if type(min_tokens) is int else 0
    text = ""
    for k in range(min(limit, len(plan.ids))):
        before = len(text)
        if plan.kinds[k] != "eos":
            text = decode(
                t for t, kind in zip(plan.ids[: k + 1], plan.kinds, strict=False) if kind != "eos"
            )
        if k + 1 <= floor:
            continue
        hits = [(text.find(s, max(0, before - len(s) + 1)), s) for s in wanted]
        hits = [(at + len(s), s) for at, s in hits if at >= 0]
        if hits:
            stop = min(hits)[1]
            del plan.ids[k + 1 :], plan.kinds[k + 1 :], plan.tool_index[k + 1 :]
            plan.stop_reason = stop
            plan.stop_token = None
            return


def cut_at_stop(text: str | None, stop: str, include: bool) -> str | None:
    """`text` as the chat route gives it after stopping on `stop` (None when it is not there):
    cut at the occurrence the last token completed, the last one (the fake's tokens are single
    bytes, so that token holds no other)."""
    if text is None or stop not in text:
        return None
    at = text.rfind(stop)
    return text[: at + len(stop)] if include else text[:at]


def message_parts(plan: Plan, n: int) -> tuple[str | None, str | None, list[PlannedCall]]:
    """(reasoning, content, tool calls) as vLLM's parsers return them for the first ``n`` tokens.

    A tool call cut short does not parse: then, as with the hermes parser, there are no tool calls
    and all the text after the reasoning is content.
    """
    ids, kinds = plan.ids[:n], plan.kinds[:n]
    reasoning = decode(t for t, k in zip(ids, kinds, strict=True) if k == "reasoning") or None
    started = [c for c in plan.calls if c.start < n]
    if all(c.end <= n for c in started):
        content = decode(t for t, k in zip(ids, kinds, strict=True) if k == "content")
        return reasoning, content or None, started
    rest = decode(t for t, k in zip(ids, kinds, strict=True) if k in _POST_REASONING)
    return reasoning, rest or None, []


_TOOL_CALL = SPECIAL_TOKENS["<tool_call>"]
_TURN_BOUNDARIES = frozenset((SPECIAL_TOKENS["<|im_start|>"], SPECIAL_TOKENS["<|im_end|>"]))


def prompt_ends_reasoning(prompt_ids: list[int], *, thinking: bool) -> bool:
    """Render's ``reasoning_ended`` as vLLM 0.32's Qwen3 parser decides it (``is_reasoning_end``
    on the prompt, vllm/parser/engine/parser_engine.py): the last reasoning marker since the
    last turn boundary is a ``</think>``; without one, reasoning is ended when `thinking` is off.
    A continued final assistant message whose reasoning closed ends it."""
    for token in reversed(prompt_ids):
        if token == THINK_END:
            return True
        if token == THINK_START:
            return False
        if token in _TURN_BOUNDARIES:
            break
    return not thinking


def reasoning_token_count(ids: list[int], *, thinking: bool = True, ended: bool = False) -> int:
    """The chat route's ``reasoning_tokens`` as vLLM 0.32's Qwen3 parser counts them (measured
    on the tiny vLLM, tests/e2e/test_vllm_parity.py and docs/upstream-facts.md): the reasoning
    phase is open from the first token unless ``enable_thinking`` is off (`thinking` false;
    whatever the prompt says: a continued message whose reasoning closed counts too) and never
    opens later; ``</think>`` or ``<tool_call>`` ends it (neither counted, nor a ``<think>``
    inside it), and the end-of-turn token a completion stopped on (`ended`) is not counted.
    (The fake parses an answer without a think block as content; vLLM's Qwen3 parser would
    call it reasoning, and counts it so.)"""
    if not thinking:
        return 0
    counted = ids[:-1] if ended and ids else ids
    count = 0
    for token in counted:
        if token in (THINK_END, _TOOL_CALL):
            break
        if token != THINK_START:
            count += 1
    return count


def stream_deltas(plan: Plan, n: int, *, include_reasoning: bool) -> list[dict[str, Any] | None]:
    """The ``delta`` of each of the first ``n`` tokens' chunks; None where vLLM's parser has none.

    Text is decoded incrementally per channel, so a multi-byte character arrives whole with its
    last byte. Tool calls stream as vLLM 0.32's hermes parser does: one delta with id, type, index
    and name once the name is complete, then the argument text piece by piece.
    """
    decoders: dict[tuple[str, int], codecs.IncrementalDecoder] = {}
    headers = {c.header: c for c in plan.calls}
    out: list[dict[str, Any] | None] = []
    for k in range(n):
        kind, tool = plan.kinds[k], plan.tool_index[k]
        delta: dict[str, Any] | None = None
        if kind in ("reasoning", "content", "tool_args"):
            dec = decoders.setdefault(
                (kind, tool), codecs.getincrementaldecoder("utf-8")("replace")
            )
            piece = dec.decode(token_bytes(plan.ids[k]))
            if piece and kind == "content":
                delta = {"content": piece}
            elif piece and kind == "reasoning" and include_reasoning:
                delta = {"reasoning": piece}
            elif piece and kind == "tool_args":
                delta = {
                    "content": None,
                    "tool_calls": [{"index": tool, "function": {"arguments": piece}}],
                }
        elif k in headers:
            call = headers[k]
            head = {
                "id": call.id,
                "type": "function",
                "index": tool,
                "function": {"name": call.name},
            }
            delta = {"content": None, "tool_calls": [head]}
        out.append(delta)
    return out


def _f32(x: float) -> float:
    # vLLM computes logprobs in float32; keep every value exactly representable.
    value: float = struct.unpack("<f", struct.pack("<f", x))[0]
    return value


def sample_logprobs(
    seed: int, prompt_ids: list[int], ids: list[int], top_k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Deterministic negative float32 logprobs for ``ids`` and ``top_k`` alternatives per position.

    Depends only on the seed, the prompt and the position, so a retried call gets the same values.
    The sampled token comes first in each top list (as in vLLM, whose logprob dict starts with it).
    """
    digest = hashlib.sha256(
        seed.to_bytes(8, "little", signed=True) + array("i", prompt_ids).tobytes()
    )
    rng = random.Random(digest.digest())
    logprobs: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for token in ids:
        u = rng.random()
        lp = _f32(-(0.02 + 4.0 * u * u))
        logprobs.append(lp)
        top: list[tuple[int, float]] = [(token, lp)] if top_k > 0 else []
        seen = {token}
        for j in range(1, top_k):
            alt = BYTE_OFFSET + (token * 7 + 37 * j) % 256
            while alt in seen:
                alt = BYTE_OFFSET + (alt + 1 - BYTE_OFFSET) % 256
            seen.add(alt)
            top.append((alt, _f32(lp - 0.25 * j - 0.5 * rng.random())))
        tops.append(top)
    return logprobs, tops


def _last_user_text(request: Mapping[str, Any]) -> str:
    for message in reversed(request.get("messages") or []):
        if isinstance(message, Mapping) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(
                    str(p.get("text", ""))
                    for p in content
                    if isinstance(p, Mapping) and p.get("type") == "text"
                )
    return ""


def default_turn(request: Mapping[str, Any]) -> Turn:
    """The answer when nothing was scripted: a little reasoning and an echo of the user's words."""
    words = _last_user_text(request).split()
    if not words:
        return Turn(content="Hello! How can I help?", reasoning="No question was asked.")
    echo = " ".join(words[:12]) + (" ..." if len(words) > 12 else "")
    reasoning = f"The user wrote {len(words)} words. I will repeat the first few."
    return Turn(content=f"You said: {echo}", reasoning=reasoning)
