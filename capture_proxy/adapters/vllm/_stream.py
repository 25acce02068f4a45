"""Relay and accumulate a streamed vLLM chat answer, sans-IO: bytes in, bytes to relay out.

`StreamAccumulator.feed` takes the upstream body in whatever chunks the network delivers and
returns, right away, the SSE events to send the client: each chunk without the fields the client
did not ask for (see `capture_proxy.adapters.vllm` for the list), the usage-only chunk dropped
unless the client asked for usage, upstream comments dropped, and ``data: [DONE]`` never relayed
(the proxy stages the call first, then sends its status comment and its own ``[DONE]``). A chunk
that needs no change is relayed as the exact bytes that arrived.

At upstream EOF `finish` checks the stream was complete and returns the `Completion`. The
data-loss policy: a stream that broke (an error event, malformed JSON, no finish reason, no
``[DONE]``, an unterminated event) raises `UpstreamProtocolError` and must not be completed for
the client; token data that cannot be staged exactly raises `CaptureExtractionError`.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from ..sse import DEFAULT_MAX_EVENT_SIZE, SSEError, SSEEvent, SSEParser, encode_event
from ._chunk import read_token_chunk
from ._ids import PrefixCache, decode_prompt
from ._wire import (
    EMPTY_OBJECT,
    NULL,
    CaptureExtractionError,
    ClientWants,
    Completion,
    Logprobs,
    Message,
    RawDict,
    UpstreamProtocolError,
    Usage,
    build_message,
    check_counts,
    decode_any,
    decode_choices,
    decode_ids,
    decode_int,
    decode_logprobs,
    decode_message,
    decode_object,
    decode_stop_reason,
    decode_str,
    decode_usage,
    encode,
    ids_from_logprob_tokens,
    is_null,
    make_extras,
    parse_error_body,
    strip_for_client,
    usage_dict,
)

__all__ = ["StreamAccumulator"]

#: Consecutive events that did not fit `read_token_chunk` before a stream stops trying it.
_MAX_FAST_MISSES = 8


class _ToolCall:
    """One tool call being assembled from deltas (OpenAI shape: fragments keyed by `index`)."""

    __slots__ = ("arguments", "id", "name", "type")

    def __init__(self) -> None:
        self.id: str | None = None
        self.type: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type or "function",
            "function": {"name": self.name, "arguments": "".join(self.arguments)},
        }


class StreamAccumulator:
    """Feed it the upstream SSE body; relay what `feed` returns; call `finish` at EOF.

    Build it with `VLLMAdapter.stream(plan)`. Never blocks, never awaits.
    """

    def __init__(
        self,
        wants: ClientWants,
        *,
        max_event_size: int = DEFAULT_MAX_EVENT_SIZE,
        prefixes: PrefixCache | None = None,
        session: str | None = None,
    ) -> None:
        self._wants = wants
        self._prefixes = prefixes
        self._session = session
        self._parser = SSEParser(max_event_size=max_event_size)
        self._closed = False
        self._saw_done = False
        self._failure: UpstreamProtocolError | None = None
        self._unstageable: CaptureExtractionError | None = None
        self._chunks = 0
        self._response_id: str | None = None
        self._model: str | None = None
        self._fingerprint: str | None = None
        #: The first chunk's prompt_token_ids, decoded at `finish`: off the time to first byte.
        self._prompt_raw: bytes | None = None
        self._ids: array[int] = array("i")
        self._logprobs: array[float] = array("f")
        self._ids_missing = False
        self._fast_misses = 0
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tools: dict[int, _ToolCall] = {}
        self._finish_reason: str | None = None
        self._stop_reason: int | str | None = None
        self._usage: Usage | None = None
        self._routed_experts: list[Any] = []
        self._media_spans: list[Any] = []

    @property
    def saw_done(self) -> bool:
        """True once the upstream sent ``data: [DONE]``."""
        return self._saw_done

    @property
    def failed(self) -> bool:
        """True once the stream is known to be broken: `finish` will raise, more input is ignored.

        The caller may stop reading the upstream early when it turns True.
        """
        return self._failure is not None

    def feed(self, chunk: bytes) -> list[bytes]:
        """Consume a piece of the upstream body; returns complete SSE events to relay now."""
        if self._closed:
            raise RuntimeError("feed() after finish()")
        if self._failure is not None:
            return []
        try:
            events = self._parser.feed(chunk)
        except SSEError as exc:
            self._fail("event_too_large", str(exc))
            return []
        out: list[bytes] = []
        for event in events:
            relay = self._on_event(event)
            if relay is not None:
                out.append(relay)
            if self._failure is not None:
                break
        return out

    def finish(self) -> Completion:
        """Check the stream ended properly and return what it produced.

        Raises `UpstreamProtocolError` (reason ``error_event``, ``malformed_json``,
        ``truncated_event``, ``empty_stream``, ``missing_finish_reason``, ``missing_done``, ...)
        or `CaptureExtractionError` (``missing_token_ids``, ``token_count_mismatch``, ...).
        """
        if not self._closed:
            self._closed = True
            if self._failure is None:
                # Only a held-back final "\r" can complete an event here: it is either [DONE] or
                # followed by nothing (then the stream lacks [DONE]), so nothing is left to relay.
                for event in self._parser.close():
                    self._on_event(event)
        if self._failure is not None:
            raise self._failure
        if self._parser.pending:
            raise UpstreamProtocolError("truncated_event", "the stream ended inside an event")
        if not self._chunks and not self._saw_done:
            raise UpstreamProtocolError("empty_stream", "the stream carried no events")
        if self._finish_reason is None:
            raise UpstreamProtocolError("missing_finish_reason", "the stream ended unfinished")
        if not self._saw_done:
            raise UpstreamProtocolError("missing_done", "the stream ended without [DONE]")
        if self._unstageable is not None:
            raise self._unstageable
        if self._ids_missing:
            raise CaptureExtractionError(
                "missing_token_ids",
                "a chunk had no token_ids and its logprob tokens are not 'token_id:N'",
            )
        prompt = self._decode_prompt()
        prompt, usage = check_counts(prompt, self._ids, self._logprobs, self._usage)
        if len(self._routed_experts) > 1 or len(self._media_spans) > 1:
            raise CaptureExtractionError(
                "routed_experts_split",
                "routed_experts/media_spans arrived in several chunks; joining them is undefined",
            )
        response_id = self._response_id or ""
        return Completion(
            response_id=response_id,
            model=self._model or "",
            prompt_token_ids=prompt,
            completion_token_ids=self._ids,
            completion_logprobs=self._logprobs,
            finish_reason=self._finish_reason,
            stop_reason=self._stop_reason,
            message=build_message(
                "".join(self._content),
                "".join(self._reasoning),
                [self._tools[i].as_dict() for i in sorted(self._tools)],
            ),
            usage=usage_dict(usage),
            extras=make_extras(
                response_id,
                self._fingerprint,
                self._stop_reason,
                self._routed_experts[0] if self._routed_experts else None,
                self._media_spans[0] if self._media_spans else None,
            ),
        )

    def _fail(self, reason: str, message: str, body: dict[str, Any] | None = None) -> None:
        if self._failure is None:
            self._failure = UpstreamProtocolError(reason, message, error_body=body)

    def _on_event(self, event: SSEEvent) -> bytes | None:
        data = event.data
        if not data:
            return None  # comments, keep-alives, id-only events: the spec dispatches nothing
        if self._saw_done:
            self._fail("data_after_done", "the upstream sent an event after [DONE]")
            return None
        if self._fast_misses < _MAX_FAST_MISSES:
            fast = read_token_chunk(data, event.raw, bool(event.comments), self._wants)
            if fast is not None:
                self._fast_misses = 0
                choice, chunk, relay = fast
                if self._response_id is None:
                    self._response_id, self._model = chunk.id, chunk.model
                self._take(choice.delta, choice.logprobs, choice.token_ids, choice.finish_reason)
                self._chunks += 1
                return relay
            # A stream whose chunks never fit the fast path stops trying it.
            self._fast_misses += 1
        if data.strip() == b"[DONE]":
            self._saw_done = True
            return None
        try:
            top = decode_object(data)
            choices = decode_choices(top["choices"]) if "choices" in top else None
            if not is_null(top.get("error")) or is_error_object(top):
                body = parse_error_body(data, 502)
                self._fail("error_event", body["error"]["message"], body)
                return None
            if choices is None:
                self._fail("no_choices", f"chunk without choices: {data[:200]!r}")
                return None
            self._accumulate(top, choices)
        except msgspec.DecodeError as exc:
            self._fail("malformed_json", f"{exc}: {data[:200]!r}")
            return None
        self._chunks += 1
        if not choices and "usage" in top and not self._wants.usage:
            return None  # the usage-only chunk the proxy asked for, not the client
        stripped = strip_for_client(top, choices, self._wants)
        if stripped is not None:
            return encode_event(encode(stripped))
        # Unchanged: relay the very bytes that arrived, unless they carry comments to drop.
        return encode_event(data) if event.comments else event.raw

    def _accumulate(self, top: RawDict, choices: list[RawDict]) -> None:
        if self._response_id is None:
            self._response_id = decode_str(top.get("id", NULL))
            self._model = decode_str(top.get("model", NULL))
        prompt = top.get("prompt_token_ids")
        if prompt is not None and self._prompt_raw is None and not is_null(prompt):
            self._prompt_raw = bytes(prompt)
        usage = top.get("usage")
        if usage is not None and not is_null(usage):
            self._usage = decode_usage(usage)
        fingerprint = decode_str(top.get("system_fingerprint", NULL))
        if fingerprint is not None:
            self._fingerprint = fingerprint
        media = top.get("media_spans")
        if media is not None and not is_null(media):
            self._media_spans.append(decode_any(media))
        for choice in choices:
            index = decode_int(choice.get("index", NULL))
            if index not in (0, None):
                self._unstageable = self._unstageable or CaptureExtractionError(
                    "multiple_choices", f"the stream carries choice index {index}"
                )
                continue
            self._choice(choice)

    def _choice(self, choice: RawDict) -> None:
        self._take(
            decode_message(choice.get("delta", EMPTY_OBJECT)),
            decode_logprobs(choice.get("logprobs", NULL)),
            decode_ids(choice.get("token_ids", NULL)),
            decode_str(choice.get("finish_reason", NULL)),
        )
        if "stop_reason" in choice:
            self._stop_reason = decode_stop_reason(choice["stop_reason"])
        for key, sink in (
            ("routed_experts", self._routed_experts),
            ("media_spans", self._media_spans),
        ):
            value = choice.get(key)
            if value is not None and not is_null(value):
                sink.append(decode_any(value))

    def _take(
        self,
        delta: Message,
        logprobs: Logprobs | None,
        ids: list[int] | None,
        finish_reason: str | None,
    ) -> None:
        """Accumulate one choice's delta, logprobs, token ids and finish reason."""
        if delta.content:
            self._content.append(delta.content)
        reasoning = delta.reasoning if delta.reasoning is not None else delta.reasoning_content
        if reasoning:
            self._reasoning.append(reasoning)
        for tc in delta.tool_calls or ():
            slot = self._tools.setdefault(tc.index, _ToolCall())
            slot.id = slot.id or tc.id
            slot.type = slot.type or tc.type
            if tc.function is not None:
                if tc.function.name:
                    slot.name = (slot.name or "") + tc.function.name
                if tc.function.arguments:
                    slot.arguments.append(tc.function.arguments)
        entries = logprobs.content if logprobs is not None and logprobs.content else []
        if ids is None and entries:
            # vLLM < 0.10.2 has no token_ids; "token_id:N" logprob tokens carry the same ids.
            ids = ids_from_logprob_tokens(entries)
            if ids is None:
                self._ids_missing = True
        if ids:
            try:
                self._ids.extend(ids)  # one id per chunk: no temporary array
            except OverflowError:
                self._unstageable = self._unstageable or CaptureExtractionError(
                    "invalid_token_ids", "token_ids: a token id does not fit in int32"
                )
        if entries:
            self._logprobs.extend([e.logprob for e in entries])
        if finish_reason:
            self._finish_reason = finish_reason

    def _decode_prompt(self) -> array[int] | None:
        raw = self._prompt_raw
        if raw is None:
            return None
        cache = self._prefixes
        try:
            prompt = decode_prompt(
                "prompt_token_ids", raw, cache.get(self._session) if cache is not None else None
            )
        except msgspec.DecodeError as exc:
            raise UpstreamProtocolError("malformed_json", f"prompt_token_ids: {exc}") from exc
        if prompt is not None and cache is not None:
            cache.put(self._session, raw, prompt, self._ids)
        return prompt


def is_error_object(top: RawDict) -> bool:
    """vLLM's older streamed errors are flat: ``{"object": "error", "message": ...}``."""
    obj = top.get("object")
    return obj is not None and bytes(obj) == b'"error"'
