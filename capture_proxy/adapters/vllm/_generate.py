"""vLLM's generate route read without I/O (``POST /inference/v1/generate``).

- `read_generate` → `Generated`: completion ids (``array('i')``), logprobs (``array('f')``,
  float32 as the chat path stores them), top logprobs when asked, finish and stop reason, weight
  spans ``(version, start, end)``, routed experts, usage;
- `GenerateStream` does the same for a streamed generate fed bytes in any pieces, giving each
  event as a `GenerateEvent` (its JSON as it came, for derender).

Each answer is decoded once (msgspec, only the fields read typed).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from ..sse import SSEError, SSEParser
from ._wire import UpstreamProtocolError

__all__ = [
    "GenerateEvent",
    "GenerateStream",
    "Generated",
    "WeightSpan",
    "malformed",
    "read_generate",
]

#: ``(version, start, end)``: the weights that sampled output positions ``[start, end)``.
WeightSpan = tuple[str, int, int]


class _Top(msgspec.Struct, gc=False):
    token_id: int
    logprob: float


class _Entry(msgspec.Struct, gc=False):
    token_id: int
    logprob: float
    top_logprobs: list[_Top] | None = None


class _Logprobs(msgspec.Struct, gc=False):
    content: list[_Entry] | None = None


class _Span(msgspec.Struct, gc=False):
    version: str
    start: int
    end: int


class _Choice(msgspec.Struct, gc=False):
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: Any = None
    weight_versions: list[_Span] | None = None
    logprobs: _Logprobs | None = None


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int | None = None


class _GenerateAnswer(msgspec.Struct, gc=False):
    request_id: str
    choices: list[_Choice]
    model: str = ""
    usage: _Usage | None = None


_decode_generate = msgspec.json.Decoder(_GenerateAnswer).decode


def malformed(route: str, exc: Exception) -> UpstreamProtocolError:
    """The error for a token-in route's answer that is not the JSON it should be."""
    return UpstreamProtocolError("malformed_json", f"the {route} answer: {exc}")


@dataclass(slots=True)
class Generated:
    """A generation (unary, or a stream's events put together)."""

    request_id: str
    completion_ids: array[int] = field(default_factory=lambda: array("i"))
    #: Empty when logprobs were not asked for.
    logprobs: array[float] = field(default_factory=lambda: array("f"))
    #: Per position, ``(token_id, logprob)`` alternatives; None when top logprobs were not asked.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_spans: tuple[WeightSpan, ...] = ()
    routed_experts: Any = None
    usage: dict[str, int] | None = None
    model: str = ""

    def add(self, choice: _Choice) -> None:
        self.completion_ids.extend(choice.token_ids)
        entries = choice.logprobs.content if choice.logprobs is not None else None
        if entries:
            self.logprobs.extend(e.logprob for e in entries)
            if any(e.top_logprobs for e in entries):
                tops = self.top_logprobs if self.top_logprobs is not None else []
                tops.extend(
                    [(t.token_id, t.logprob) for t in e.top_logprobs or ()] for e in entries
                )
                self.top_logprobs = tops
        if choice.finish_reason is not None:
            self.finish_reason = choice.finish_reason
            self.stop_reason = choice.stop_reason
        if choice.weight_versions is not None:
            self.weight_spans = tuple((s.version, s.start, s.end) for s in choice.weight_versions)
        if choice.routed_experts is not None:
            self.routed_experts = choice.routed_experts


def _usage(u: _Usage) -> dict[str, int]:
    total = u.total_tokens if u.total_tokens is not None else u.prompt_tokens + u.completion_tokens
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": total,
    }


def read_generate(raw: bytes) -> Generated:
    """Read a unary generate answer; `UpstreamProtocolError` for a malformed one."""
    try:
        answer = _decode_generate(raw)
    except msgspec.DecodeError as exc:
        raise malformed("generate", exc) from exc
    if len(answer.choices) != 1:
        raise UpstreamProtocolError("no_choices", f"{len(answer.choices)} choices, not 1")
    out = Generated(answer.request_id, model=answer.model)
    out.add(answer.choices[0])
    if out.finish_reason is None:
        raise UpstreamProtocolError("missing_finish_reason", "choices[0] has no finish_reason")
    out.usage = _usage(answer.usage) if answer.usage is not None else None
    return out


@dataclass(frozen=True, slots=True)
class GenerateEvent:
    """One event of a streamed generate: its JSON as it came (a derender ``generate_chunk``,
    forwarded without re-encoding), how many output ids it brought, and whether it has choices
    (the usage event has none)."""

    data: bytes
    new_ids: int
    has_choices: bool
    #: The event's output ids, as decoded, when it has one choice, no logprob entries and no
    #: usage: all `capture_proxy.adapters.vllm.merge_chunks` needs of it (None otherwise).
    ids: list[int] | None = None


class GenerateStream:
    """A streamed generate read incrementally: `feed` bytes (any split), get `GenerateEvent` s;
    `generated` accumulates the ids, logprobs, spans, finish reason and usage; `done` is True
    once ``[DONE]`` arrived."""

    def __init__(self) -> None:
        self._sse = SSEParser()
        self.generated: Generated | None = None
        self.done = False

    def feed(self, data: bytes) -> list[GenerateEvent]:
        try:
            events = self._sse.feed(data)
        except SSEError as exc:
            raise UpstreamProtocolError("event_too_large", str(exc)) from exc
        out: list[GenerateEvent] = []
        for event in events:
            if not event.data:
                continue
            if self.done:
                raise UpstreamProtocolError("data_after_done", "an event after [DONE]")
            if event.data == b"[DONE]":
                self.done = True
                continue
            try:
                typed = _decode_generate(event.data)
            except msgspec.DecodeError as exc:
                if isinstance(chunk_error := _error_of(event.data), dict):
                    raise UpstreamProtocolError(
                        "error_event", str(chunk_error), error_body=chunk_error
                    ) from exc
                raise malformed("generate stream", exc) from exc
            gen = self.generated
            if gen is None:
                gen = self.generated = Generated(typed.request_id)
            n = 0
            for choice in typed.choices:
                gen.add(choice)
                n += len(choice.token_ids)
            if typed.usage is not None:
                gen.usage = _usage(typed.usage)
            ids = None
            if len(typed.choices) == 1 and typed.usage is None:
                choice = typed.choices[0]
                if choice.logprobs is None or not choice.logprobs.content:
                    ids = choice.token_ids
            out.append(GenerateEvent(event.data, n, bool(typed.choices), ids))
        return out

    def finish(self) -> Generated:
        """The whole generation; `UpstreamProtocolError` when the stream ended early."""
        if self._sse.close() or not self.done:
            raise UpstreamProtocolError("missing_done", "the generate stream ended without [DONE]")
        if self.generated is None or self.generated.finish_reason is None:
            raise UpstreamProtocolError("missing_finish_reason", "no event had a finish_reason")
        return self.generated


def _error_of(data: bytes) -> Any:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) and "error" in value else None
