"""vLLM's derender route written and read without I/O (``POST /v1/chat/completions/derender``).

- `derender_body` / `derender_chunk_body` build derender requests (`derender_tail`: the prompt
  ids and chat request every call of a stream resends, encoded once; the prompt ids may come
  encoded, as generate got them); `read_derender` reads a streamed call's answer (the unary one:
  `read_derendered` in ``_derendered.py``);
- `derender_chat_request` and `derender_prompt_start` say how little of the chat request and of
  the prompt ids derender needs for the same answer (what each call resends);
- `merge_chunks` joins a stream's generate events into one ``generate_chunk``, and
  `DerenderCoalescer` decides which of them go into one derender call;
- `to_completion` turns a generation and its derendered message into the `Completion` the plain
  path stages.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
import orjson

from ._generate import Generated, GenerateEvent, malformed
from ._ids_json import encode_ids
from ._wire import Completion, UpstreamProtocolError, build_message, make_extras

__all__ = [
    "SEED_IDS",
    "DerenderCoalescer",
    "derender_body",
    "derender_chat_request",
    "derender_chunk_body",
    "derender_generate_answer",
    "derender_prompt_start",
    "derender_tail",
    "merge_chunks",
    "read_derender",
    "to_completion",
    "usage_chunk",
]


def merge_chunks(events: Sequence[GenerateEvent]) -> bytes:
    """Several generate events as one ``generate_chunk`` (JSON): ids and logprobs joined, the
    last event's finish reason, spans and usage (derender accepts a chunk of many ids). One event
    is returned as it came."""
    if len(events) == 1:
        return events[0].data
    if all(e.ids is not None for e in events):
        # Without logprobs or usage, the merge needs of the events before the last only their
        # ids, already decoded: the last one is the only one decoded again.
        merged = orjson.loads(events[-1].data)
        last = dict(merged["choices"][0])
        last["token_ids"] = [t for e in events for t in e.ids or ()]
        last["logprobs"] = None
        merged["choices"] = [last]
        merged["usage"] = None
        return orjson.dumps(merged)
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


#: The prompt's last ids vLLM 0.32's derender decodes the answer after (its incremental
#: detokenizer is seeded with the last ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2`` = 7,
#: `convert_prompt_ids_to_tokens`); one more kept.
SEED_IDS: Final = 8

#: A tool call as derender counts it in the history (`derender_chat_request`).
_COUNTED_CALL: Final = {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}


#: Chat request keys derender never reads: sampling and serving keys, which only a generation
#: reads (vLLM 0.32's ``online_derenderer.py`` and the parsers it builds read none of them; it
#: resolves logprobs from the generate answer's entries, whatever the request's ``logprobs``).
_UNREAD: Final = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "max_completion_tokens",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "length_penalty",
        "n",
        "logit_bias",
        "user",
        "stop",
        "stop_token_ids",
        "min_tokens",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "priority",
        "cache_salt",
        "kv_transfer_params",
        "metadata",
        "store",
        "service_tier",
        "model",
    }
)


def derender_chat_request(
    chat_request: Mapping[str, Any], *, token_ids: bool = True
) -> dict[str, Any]:
    """The chat request a derender call needs: every key as it is but ``messages``, whose text
    it does not read, and the keys it never reads (`_UNREAD`). vLLM 0.32's derender
    (``online_derenderer.py``, the parsers it builds) reads the request's tools, tool choice,
    template keys, ``include_reasoning``, ``return_token_ids``, the special-token keys,
    ``response_format``, ``structured_outputs`` and ``parallel_tool_calls``; of the messages,
    only how many tool calls the assistant turns made (``count_history_tool_calls``, for
    Kimi-style tool call ids). So the messages become one stub per assistant turn with tool calls
    (as many calls, empty arguments), none without, and the function tools keep
    only their name and parameters, without the parameters' descriptions
    (`_without_description`): a stream's derender calls resend this instead of the
    conversation. Without `token_ids` (the client did not ask for them: its answer's come from
    generate when it does), ``return_token_ids`` goes too."""
    messages = chat_request.get("messages")
    if not isinstance(messages, list):
        return dict(chat_request)
    kept: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            continue
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            kept.append(
                {"role": "assistant", "content": "", "tool_calls": [_COUNTED_CALL] * len(calls)}
            )
    unread = _UNREAD if token_ids else _UNREAD | {"return_token_ids"}
    slim: dict[str, Any] = {k: v for k, v in chat_request.items() if k not in unread}
    slim["messages"] = kept
    tools = chat_request.get("tools")
    if isinstance(tools, list):
        slim["tools"] = [_without_description(tool) for tool in tools]
    return slim


def _without_description(tool: Any) -> Any:
    """A function tool as derender reads it: its function's name and parameters (derender's
    parsers read those: ``find_tool_name``, ``find_tool_properties``), without the function's
    ``description`` nor its parameters' (a JSON schema's annotation, read only by the grammar
    a generation is constrained by: ``adjust_request``, the structural tags, which derender
    does not build), and without ``"type": "function"``, the default of vLLM's
    ``ChatCompletionToolsParam``."""
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
        return tool
    slim = {k: v for k, v in function.items() if k != "description"}
    if "parameters" in slim:
        slim["parameters"] = _schema_without_descriptions(slim["parameters"])
    return {**{k: v for k, v in tool.items() if k != "type"}, "function": slim}


#: JSON schema keywords whose value maps names (of properties, definitions) to schemas.
_NAMED_SCHEMAS: Final = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
#: JSON schema keywords whose value is data, not a schema (never walked into).
_DATA: Final = frozenset({"enum", "const", "default", "examples", "required"})


def _schema_without_descriptions(schema: Any) -> Any:
    """A JSON schema without its ``description`` annotations (the text ones), at every level;
    property names (``properties``' keys, ``description`` among them) and data (``enum``,
    ``default``, ...) are kept as they are."""
    if isinstance(schema, list):
        return [_schema_without_descriptions(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "description" and isinstance(value, str):
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, Mapping):
            out[key] = {name: _schema_without_descriptions(s) for name, s in value.items()}
        elif key in _DATA:
            out[key] = value
        else:
            out[key] = _schema_without_descriptions(value)
    return out


_decode_top = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_choices = msgspec.json.Decoder(list[dict[str, msgspec.Raw]]).decode
_NULL = msgspec.Raw(b"null")
_TOKENS = msgspec.Raw(b'"tokens"')
#: What vLLM 0.32's derender does not read of a generate answer's choice, and of a unary one.
_CHOICE_UNREAD: Final = frozenset({"weight_versions", "routed_experts", "sampling_mask"})
_UNARY_UNREAD: Final = frozenset({"model", "created", "usage"})


def derender_generate_answer(answer: bytes, *, logprobs: bool, unary: bool = False) -> bytes:
    """Generate's answer (unary, or with `unary` false a stream's ``generate_chunk``) as a
    derender call reads it: without its null fields and ``output_mode: "tokens"`` (the defaults
    of vLLM 0.32's ``GenerateTokensResponse``), the choices' ``weight_versions``,
    ``routed_experts`` and ``sampling_mask`` (which derender does not read), a unary answer's
    ``model``, ``created`` and ``usage`` (its answer has vLLM's own: ``derender/serving.py``),
    and, unless `logprobs` (the client asked for them), the choices' ``logprobs`` (derender
    resolves the entries it gets; the client would not get them). The values kept go as they
    came; an answer that is not an object of that shape goes as it is (derender says what is
    wrong with it)."""
    try:
        top = _decode_top(answer)
        raw_choices = top.get("choices")
        choices = _decode_choices(raw_choices) if raw_choices is not None else None
    except msgspec.DecodeError:
        return answer
    unread = _UNARY_UNREAD if unary else ()
    kept: list[bytes] = []
    for key, value in top.items():
        if key == "choices" and choices is not None:
            kept.append(b'"choices":[' + b",".join(_choice(c, logprobs) for c in choices) + b"]")
        elif value != _NULL and key not in unread and (key, value) != ("output_mode", _TOKENS):
            kept.append(orjson.dumps(key) + b":" + bytes(value))
    return b"{" + b",".join(kept) + b"}"


def _choice(choice: Mapping[str, msgspec.Raw], logprobs: bool) -> bytes:
    kept = [
        orjson.dumps(key) + b":" + bytes(value)
        for key, value in choice.items()
        if value != _NULL and key not in _CHOICE_UNREAD and (logprobs or key != "logprobs")
    ]
    return b"{" + b",".join(kept) + b"}"


def derender_prompt_start(prompt: array[int], markers: Sequence[int] | None) -> int:
    """Where the prompt ids a derender call needs start: derender gives the same answer for
    ``prompt[start:]`` as for the whole prompt.

    vLLM 0.32's derender reads the prompt twice: the last `SEED_IDS` ids seed its detokenizer,
    and its reasoning parser decides whether the prompt left reasoning open
    (``is_reasoning_end``) by reading the prompt backwards from its end until a reasoning start
    or end marker (a ``<think>``-style parser), or a turn boundary (Qwen3's parser engine),
    whichever comes first. `markers` are the reasoning parser's marker ids: the ids from the
    last of them on (or the last `SEED_IDS`, when that is fewer) are what it reads. ``()``: the
    server has no reasoning parser, the last `SEED_IDS` are enough. None: a reasoning parser
    whose markers are not known, the whole prompt (0)."""
    if markers is None:
        return 0
    start = max(len(prompt) - SEED_IDS, 0)
    if not markers or start == 0:
        return start
    raw = prompt.tobytes()
    last = max(_last_index(raw, array(prompt.typecode, [m]).tobytes()) for m in markers)
    return last if 0 <= last < start else start


def _last_index(raw: bytes, needle: bytes) -> int:
    """The index of the last id of `raw` (an array's bytes) that is `needle`, -1 for none."""
    end = len(raw)
    while (at := raw.rfind(needle, 0, end)) >= 0:
        if at % len(needle) == 0:  # an id, not the bytes across two
            return at // len(needle)
        end = at + len(needle) - 1
    return -1


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
    return b"".join((b'{"generate_response":', generate_answer, tail))  # one copy, not two


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
    if state is None:  # the first call: vLLM's default (``stream_state: None``) goes unsaid
        return b"".join((b'{"stream":true,"generate_chunk":', chunk, tail))
    return b"".join(
        (b'{"stream":true,"generate_chunk":', chunk, b',"stream_state":', orjson.dumps(state), tail)
    )


def read_derender(raw: bytes) -> dict[str, Any]:
    """A derender answer, decoded (a ``chat.completion``, or ``{chunk, stream_state}``)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise malformed("derender", exc) from exc
    if not isinstance(value, dict):
        raise UpstreamProtocolError("malformed_json", "the derender answer is not an object")
    return value


class DerenderCoalescer:
    """Which streamed generate events go into each derender call, and when, sans-IO.

    Every derender call resends the chat request and every output id so far, so one call per
    event costs O(n²) in the output length. The policy: the first event is derendered alone (the
    client's first byte comes early); then everything that arrived while the previous call was in
    flight goes in one call, but a call starts no sooner than `min_interval` seconds after the
    previous one started (when decoding is slower than a derender call, that floor is what keeps
    the calls few); once the stream ended (`close`), the rest goes at once. The usage event (no
    choices) always goes in a call of its own, as vLLM streams it apart from the last token.

    With a `budget` (bytes), the bytes the calls sent (`spend`) bound them, whatever the pace of
    the stream: a call starts before the stream ended only while what was sent, that call and
    one more of the same size (the last one, with the rest of the stream) fit in the budget
    (`call_bytes`: the largest call so far, at first the caller's estimate); otherwise the rest
    goes in one call when the stream ends. A stream's derender calls then send at most the
    budget, unless the last call is larger than the ones before it (it carries every output id
    in its state, and the events not sent yet).

    `add` an event as it arrives; `take(now)` gives the chunk to derender now, or None (a call in
    flight, nothing waiting, or too soon: `due` says when); `finished` says the call came back.
    """

    def __init__(
        self, min_interval: float = 0.05, budget: int | None = None, call_bytes: int = 0
    ) -> None:
        self.min_interval = min_interval
        self.budget = budget
        #: Bytes the calls sent so far (`spend`).
        self.spent = 0
        #: The bytes of one call, as far as known: the largest so far (`spend`).
        self.call_bytes = call_bytes
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

    def spend(self, size: int) -> None:
        """A call sent `size` bytes."""
        self.spent += size
        self.call_bytes = max(self.call_bytes, size)

    @property
    def held(self) -> bool:
        """Whether the budget holds every call back until the stream ends: a call now and the
        last one would not fit in what is left of it."""
        budget = self.budget
        return budget is not None and not self.closed and self.spent + 2 * self.call_bytes > budget

    def due(self) -> float | None:
        """When the next call may start (clock of `take`), None when it may start now or not
        before the stream ends (`held`)."""
        if self.closed or self._last_start is None or self.held:
            return None
        return self._last_start + self.min_interval

    def take(self, now: float) -> bytes | None:
        waiting = self._waiting
        if self.in_flight or not waiting or self.held:
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

    def take_usage(self, now: float) -> bytes | None:
        """The usage event, when it is the next to go (a call may start now): it needs no
        derender call of its own (`usage_chunk`), so it counts as none."""
        waiting = self._waiting
        if self.in_flight or not waiting or waiting[0].has_choices or self.held:
            return None
        due = self.due()
        if due is not None and now < due:
            return None
        self._waiting = waiting[1:]
        return waiting[0].data


#: The keys of the usage derender gives a usage-only chunk, in its order.
_USAGE_KEYS = ("prompt_tokens", "total_tokens", "completion_tokens")


def usage_chunk(previous: Mapping[str, Any], event: bytes) -> dict[str, Any] | None:
    """The client's usage-only chunk for generate's usage `event`, as vLLM 0.32's derender
    writes it, without a derender call: the stream's previous derendered chunk's fields with
    no choices and generate's usage (its counts, then null details). None when the event has
    no such usage (derender is then asked).

    Derender adds nothing of its own to that chunk (tests/fixtures/vllm-0.32.0/token-in/
    derender-*-stream.json, its last answer) but its clock's `created`; the previous chunk's
    is used, which is what the chat route gives every chunk of a stream."""
    try:
        usage = orjson.loads(event).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(usage, dict) or any(type(usage.get(k)) is not int for k in _USAGE_KEYS):
        return None
    counts: dict[str, Any] = {k: usage[k] for k in _USAGE_KEYS}
    counts["prompt_tokens_details"] = usage.get("prompt_tokens_details")
    counts["completion_tokens_details"] = usage.get("completion_tokens_details")
    return {**previous, "choices": [], "usage": counts}


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
