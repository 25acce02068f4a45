"""vLLM's token-in routes read and written without I/O: render, generate, derender.

The token-in path asks vLLM to render the chat request (``POST /v1/chat/completions/render``),
generates from token ids (``POST /inference/v1/generate``) and builds the client's answer with
``POST /v1/chat/completions/derender``. The shapes are vLLM 0.32's (docs/upstream-facts.md,
"Token-in routes (vLLM 0.32, measured)"). Each answer is decoded once (msgspec, only the fields
read typed); what is sent back is built from the decoded values:

- `read_render` → `Rendered`: the prompt ids (a list, each checked to be an int as it is
  decoded; with ``known``, only from where their JSON differs from a known list's), their JSON
  as it came, the resolved sampling params, ``features``, and `Rendered.generate_body` —
  the render answer sent back with ``token_ids`` replaced, its other fields as they came (kept
  undecoded); `read_render_pair` reads of two answers (the bridge's pairs) only the ids from
  where their common suffix starts, and ``features``;
- `read_generate` → `Generated`: completion ids (``array('i')``), logprobs (``array('f')``,
  float32 as the chat path stores them), top logprobs when asked, finish and stop reason, weight
  spans ``(version, start, end)``, routed experts, usage; `GenerateStream` does the same for a
  streamed generate fed bytes in any pieces;
- `derender_body` / `derender_chunk_body` build derender requests (`derender_tail`: the prompt
  ids and chat request every call of a stream resends, encoded once; the prompt ids may come
  encoded, as generate got them); `read_derender` reads a streamed call's answer (the unary one:
  `read_derendered` in ``_derendered.py``); `DerenderCoalescer` decides which streamed chunks go
  into one derender call;
- `to_completion` turns a generation and its derendered message into the `Completion` the plain
  path stages.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from ..sse import SSEError, SSEParser
from ._ids_json import encode_ids, ids_after_known
from ._wire import Completion, UpstreamProtocolError, build_message, make_extras

__all__ = [
    "DerenderCoalescer",
    "GenerateEvent",
    "GenerateStream",
    "Generated",
    "Rendered",
    "WeightSpan",
    "derender_body",
    "derender_chunk_body",
    "derender_tail",
    "merge_chunks",
    "read_derender",
    "read_generate",
    "read_render",
    "read_render_pair",
    "to_completion",
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


def _malformed(route: str, exc: Exception) -> UpstreamProtocolError:
    return UpstreamProtocolError("malformed_json", f"the {route} answer: {exc}")


_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_ids = msgspec.json.Decoder(list[int]).decode
_decode_object = msgspec.json.Decoder(dict[str, Any]).decode
_NULL = msgspec.Raw(b"null")
#: The render answer's fields `Rendered.generate_body` writes itself.
_WRITTEN = frozenset({"token_ids", "stream", "stream_options"})
_STREAM = b'"stream":true,"stream_options":{"include_usage":true}'


@dataclass(frozen=True, slots=True)
class Rendered:
    """A render answer: what generate needs, and the rest of it to send back unchanged."""

    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    features: Any
    #: The answer's other fields (a ``GenerateRequest``'s), each its JSON as it came: sent
    #: back to generate without being decoded or encoded again.
    rest: Mapping[str, msgspec.Raw]
    #: The answer's ``stream`` and ``stream_options``, those it has, as they came: sent back
    #: in a unary generate request (a streamed one sets its own).
    unary: Mapping[str, msgspec.Raw] = field(default_factory=dict)
    #: `prompt_ids` as the JSON they came as (None: encode them when needed).
    ids_json: bytes | None = None

    @property
    def prompt_json(self) -> bytes:
        """`prompt_ids` as a JSON list: as they came when known, else encoded."""
        return self.ids_json if self.ids_json is not None else encode_ids(self.prompt_ids)

    def generate_body(
        self,
        prompt_ids: Sequence[int] | None = None,
        *,
        stream: bool = False,
        sampling_params: Mapping[str, Any] | None = None,
        ids_json: bytes | None = None,
    ) -> bytes:
        """The generate request: the render answer with ``token_ids`` replaced by `prompt_ids`
        (default: the rendered ones) and ``sampling_params`` by `sampling_params` (default: the
        rendered ones), streamed with usage when `stream`. `ids_json`, when given, is the ids
        already encoded (a JSON list), sent as they are."""
        parts = [b"{"]
        for key, value in self.rest.items():
            if sampling_params is None or key != "sampling_params":
                parts += (orjson.dumps(key), b":", value, b",")
        if sampling_params is not None:
            parts += (b'"sampling_params":', orjson.dumps(sampling_params), b",")
        if stream:
            parts += (_STREAM, b",")
        else:
            for key, value in self.unary.items():
                parts += (orjson.dumps(key), b":", value, b",")
        if ids_json is None:
            ids_json = self.prompt_json if prompt_ids is None else encode_ids(prompt_ids)
        parts += (b'"token_ids":', ids_json, b"}")
        return b"".join(parts)


def read_render(raw: bytes, known: tuple[bytes, Sequence[int]] | None = None) -> Rendered:
    """Read a render answer once, its ids checked as they are decoded (msgspec); the fields
    generate takes back unchanged stay as they came. `UpstreamProtocolError` when it is not a
    ``GenerateRequest``.

    `known` is a JSON list and the ids it holds (checked ints), which the answer's ids likely
    start with (a bridged prompt, against the plain rendering of the same request): the
    answer's ids are decoded only from the first one whose JSON is not byte for byte the same
    as `known`'s; those before it are `known`'s (the same bytes are the same ids)."""
    fields = _fields("render", raw)
    ids, features = _ids_and_features(fields, known)
    ids_json = bytes(fields["token_ids"])
    params = fields.get("sampling_params", _NULL)
    try:
        decoded = {} if params == _NULL else _decode_object(params)
    except msgspec.DecodeError:  # not an object: none read (generate gets it as it came)
        decoded = {}
    return Rendered(
        prompt_ids=ids,
        sampling_params=decoded,
        features=features,
        rest={k: v for k, v in fields.items() if k not in _WRITTEN},
        unary={k: v for k, v in fields.items() if k in ("stream", "stream_options")},
        ids_json=ids_json,
    )


class _RenderRaw(msgspec.Struct, gc=False):
    token_ids: msgspec.Raw
    features: Any = None


_decode_render_raw = msgspec.json.Decoder(_RenderRaw).decode
#: Bytes between two ids of a JSON list.
_SEPARATORS = frozenset(b"[, \t\r\n")


def read_render_pair(first: bytes, second: bytes) -> tuple[tuple[list[int], list[int]], Any]:
    """Two render answers that differ in one message's content (the bridge's pairs): of each,
    the token ids from the last one that is not in their common suffix to the end (the whole
    list when there is none: for two answers with the same ids, both lists), and the
    ``features`` of each (None when null).

    The common suffix of the two returned lists is the answers' common suffix, and they are the
    same exactly when the answers' lists are: all the bridge reads of a pair, without decoding
    the ids the two share at their start (an agent's system prompt and tools: most of them).
    Those are checked to be JSON, the returned ones to be ints. `UpstreamProtocolError` as
    `read_render`.
    """
    (a, a_features), (b, b_features) = _render_raw(first), _render_raw(second)
    shared = _common_suffix_len(a, b)
    ids = (_decode_tail(a, len(a) - shared), _decode_tail(b, len(b) - shared))
    return ids, (a_features, b_features)


def _render_raw(raw: bytes) -> tuple[bytes, Any]:
    """A render answer's ``token_ids`` as the JSON it came as, and its ``features``."""
    try:
        answer = _decode_render_raw(raw)
    except msgspec.ValidationError as exc:
        raise UpstreamProtocolError("no_token_ids", f"the render answer: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise _malformed("render", exc) from exc
    ids = bytes(answer.token_ids)
    if not (ids.startswith(b"[") and ids.endswith(b"]")):
        raise UpstreamProtocolError("no_token_ids", "the render answer has no token_ids list")
    return ids, answer.features


def _common_suffix_len(a: bytes, b: bytes) -> int:
    """How many bytes `a` and `b` end with in common: blocks compared in C, then bytes."""
    n = min(len(a), len(b))
    k = 0
    for block in (4096, 256, 16, 1):
        while (
            k + block <= n
            and a[len(a) - k - block : len(a) - k] == b[len(b) - k - block : len(b) - k]
        ):
            k += block
    return k


def _decode_tail(ids: bytes, start: int) -> list[int]:
    """The ids of the JSON list `ids` from the last one with a byte before `start`: not one of
    the ids its common suffix with the other list has (those are byte for byte the same, with
    the separator before them). The whole list when there is none."""
    j = start - 1
    while j > 0 and ids[j] in _SEPARATORS:
        j -= 1
    begin = max(ids.rfind(b",", 0, j), ids.rfind(b"[", 0, j)) + 1 if j > 0 else 1
    tail = b"[" + ids[begin:]
    try:
        return _decode_ids(tail)
    except msgspec.DecodeError as exc:
        raise UpstreamProtocolError(
            "no_token_ids", f"the render answer's token_ids: {exc}"
        ) from exc


def _fields(route: str, raw: bytes) -> dict[str, msgspec.Raw]:
    try:
        return _decode_fields(raw)
    except msgspec.ValidationError as exc:
        raise UpstreamProtocolError("no_token_ids", f"the {route} answer is not an object") from exc
    except msgspec.DecodeError as exc:
        raise _malformed(route, exc) from exc


def _ids_and_features(
    fields: Mapping[str, msgspec.Raw], known: tuple[bytes, Sequence[int]] | None = None
) -> tuple[list[int], Any]:
    value = fields.get("token_ids")
    try:
        if value is None:
            ids = None
        elif known is None:
            ids = _decode_ids(value)
        else:
            ids = ids_after_known(bytes(value), *known)
    except msgspec.DecodeError:
        ids = None
    if ids is None:
        raise UpstreamProtocolError("no_token_ids", "the render answer has no token_ids list")
    features = fields.get("features", _NULL)
    return ids, None if features == _NULL else msgspec.json.decode(features)


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
        raise _malformed("generate", exc) from exc
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
                raise _malformed("generate stream", exc) from exc
            gen = self.generated
            if gen is None:
                gen = self.generated = Generated(typed.request_id)
            n = 0
            for choice in typed.choices:
                gen.add(choice)
                n += len(choice.token_ids)
            if typed.usage is not None:
                gen.usage = _usage(typed.usage)
            out.append(GenerateEvent(event.data, n, bool(typed.choices)))
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


def merge_chunks(events: Sequence[GenerateEvent]) -> bytes:
    """Several generate events as one ``generate_chunk`` (JSON): ids and logprobs joined, the
    last event's finish reason, spans and usage (derender accepts a chunk of many ids). One event
    is returned as it came."""
    if len(events) == 1:
        return events[0].data
    chunks = [orjson.loads(e.data) for e in events]
    merged = dict(chunks[-1])
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    if choices:
        last = dict(choices[-1])
        last["token_ids"] = [t for c in choices for t in c.get("token_ids") or ()]
        logprobs = [e for c in choices for e in (c.get("logprobs") or {}).get("content") or ()]
        last["logprobs"] = {"content": logprobs} if logprobs else None
        merged["choices"] = [last]
    merged["usage"] = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    return orjson.dumps(merged)


def derender_body(
    generate_answer: bytes,
    prompt_ids: Sequence[int],
    chat_request: Mapping[str, Any] | bytes,
    *,
    ids_json: bytes | None = None,
) -> bytes:
    """The unary derender request: generate's answer as it came, the prompt ids, the chat
    request (vLLM needs all three when a reasoning or tool parser is configured; `chat_request`
    may be given already encoded, and the prompt ids as `ids_json`, a JSON list)."""
    tail = derender_tail(prompt_ids, chat_request, ids_json=ids_json)
    return b'{"generate_response":' + generate_answer + tail


def derender_tail(
    prompt_ids: Sequence[int],
    chat_request: Mapping[str, Any] | bytes,
    *,
    ids_json: bytes | None = None,
) -> bytes:
    """The end of every derender request of one call: the prompt ids and the chat request,
    encoded once for all of a stream's derender calls (`derender_chunk_body`); `ids_json`, when
    given, is the prompt ids already encoded."""
    ids = ids_json if ids_json is not None else encode_ids(prompt_ids)
    chat = chat_request if isinstance(chat_request, bytes) else orjson.dumps(chat_request)
    return b"".join((b',"prompt_token_ids":', ids, b',"chat_request":', chat, b"}"))


def derender_chunk_body(chunk: bytes, state: Mapping[str, Any] | None, tail: bytes) -> bytes:
    """One streamed derender request: the chunk (JSON, from `merge_chunks`), the previous
    answer's ``stream_state``, and — required on every call — the prompt ids and the chat
    request, as `derender_tail` encoded them once."""
    return b"".join(
        (b'{"stream":true,"generate_chunk":', chunk, b',"stream_state":', orjson.dumps(state), tail)
    )


def read_derender(raw: bytes) -> dict[str, Any]:
    """A derender answer, decoded (a ``chat.completion``, or ``{chunk, stream_state}``)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _malformed("derender", exc) from exc
    if not isinstance(value, dict):
        raise UpstreamProtocolError("malformed_json", "the derender answer is not an object")
    return value


class DerenderCoalescer:
    """Which streamed generate events go into each derender call, and when, sans-IO.

    Every derender call resends the whole prompt and every output id so far, so one call per
    event costs O(n²) in the output length (16k prompt ids, 1k tokens: 84 MB of requests). The
    policy: the first event is derendered alone (the client's first byte comes early); then
    everything that arrived while the previous call was in flight goes in one call, but a call
    starts no sooner than `min_interval` seconds after the previous one started (when decoding
    is slower than a derender call, that floor is what keeps the calls few); once the stream
    ended (`close`), the rest goes at once. The usage event (no choices) always goes in a call of
    its own, as vLLM streams it apart from the last token.

    `add` an event as it arrives; `take(now)` gives the chunk to derender now, or None (a call in
    flight, nothing waiting, or too soon: `due` says when); `finished` says the call came back.
    """

    def __init__(self, min_interval: float = 0.05) -> None:
        self.min_interval = min_interval
        self._waiting: list[GenerateEvent] = []
        self._last_start: float | None = None
        self.in_flight = False
        self.closed = False
        self.calls = 0

    def add(self, event: GenerateEvent) -> None:
        self._waiting.append(event)

    def close(self) -> None:
        """The generate stream ended: what waits goes without delay."""
        self.closed = True

    @property
    def pending(self) -> bool:
        return bool(self._waiting)

    def due(self) -> float | None:
        """When the next call may start (clock of `take`), None when it may start now."""
        if self.closed or self._last_start is None:
            return None
        return self._last_start + self.min_interval

    def take(self, now: float) -> bytes | None:
        waiting = self._waiting
        if self.in_flight or not waiting:
            return None
        due = self.due()
        if due is not None and now < due:
            return None
        k = next((i for i, e in enumerate(waiting) if not e.has_choices), len(waiting))
        k = k or 1
        chunk = merge_chunks(waiting[:k])
        self._waiting = waiting[k:]
        self.in_flight = True
        self._last_start = now
        self.calls += 1
        return chunk

    def finished(self) -> None:
        self.in_flight = False


def to_completion(
    generated: Generated,
    prompt_ids: array[int],
    derendered: Mapping[str, Any],
    *,
    model: str = "",
) -> Completion:
    """The staged `Completion` of a token-in call: the ids and logprobs from generate, the
    message (content, reasoning, tool calls) from derender's answer."""
    choices = derendered.get("choices") or [{}]
    message = choices[0].get("message") or {}
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    calls = [
        {
            "id": c.get("id"),
            "type": c.get("type") or "function",
            "function": {
                "name": (c.get("function") or {}).get("name"),
                "arguments": (c.get("function") or {}).get("arguments") or "",
            },
        }
        for c in message.get("tool_calls") or ()
    ]
    n = len(generated.completion_ids)
    usage = generated.usage or {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": n,
        "total_tokens": len(prompt_ids) + n,
    }
    return Completion(
        response_id=generated.request_id,
        model=generated.model or model,
        prompt_token_ids=prompt_ids,
        completion_token_ids=generated.completion_ids,
        completion_logprobs=generated.logprobs,
        finish_reason=generated.finish_reason or "",
        stop_reason=generated.stop_reason,
        message=build_message(message.get("content"), reasoning, calls),
        usage=usage,
        extras=make_extras(
            generated.request_id, None, generated.stop_reason, generated.routed_experts, None
        ),
    )
