"""The vLLM dialect: what to ask vLLM for, and how to read its non-streamed answers.

`VLLMAdapter.plan` turns the proxy's normalized request into the exact bytes to forward, asking
vLLM for the token-level data a record needs (``return_token_ids``, ``logprobs``, usage on streams)
and remembering what the client itself asked for (`ClientWants`). `parse_response` decodes the
answer once: the top level as raw JSON values, only the fields it reads into typed Structs (an
answer of exactly vLLM 0.32's shape in a single typed pass, `_answer.read_answer`); it
rebuilds the client's body from the untouched raw values minus what the client did not ask for,
and returns the extraction as a `Completion`. `stream` returns a sans-IO `StreamAccumulator` for
streamed answers.

What the client gets back, compared with vLLM's own answer:

- ``prompt_token_ids``, ``prompt_text`` and each choice's ``token_ids`` are removed unless the
  client itself sent ``return_token_ids: true``;
- each choice's ``logprobs`` becomes null (what vLLM sends when logprobs were not requested;
  OpenAI's schema requires the key) unless the client sent ``logprobs: true``, in which case it
  is relayed exactly as vLLM sent it;
- each choice's ``routed_experts`` is removed (it is captured into the record's extras);
- ``prompt_logprobs``, ``kv_transfer_params`` and ``ec_transfer_params`` are removed when null:
  the proxy never asks for them, so a non-null value means the client did, and it is kept;
- everything else is relayed byte for byte, unknown fields included.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec
import orjson

from ._answer import read_answer
from ._ids import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, decode_prompt
from ._stream import StreamAccumulator
from ._wire import (
    EMPTY_OBJECT,
    NULL,
    CaptureExtractionError,
    ClientWants,
    Completion,
    ForwardPlan,
    Logprobs,
    RawDict,
    ReasoningField,
    UpstreamProtocolError,
    build_message,
    check_counts,
    decode_any,
    decode_choices,
    decode_ids,
    decode_logprobs,
    decode_message,
    decode_object,
    decode_stop_reason,
    decode_str,
    decode_usage,
    encode,
    ids_from_logprob_tokens,
    make_extras,
    normalize_tool_call,
    parse_error_body,
    strip_for_client,
    to_ids,
    usage_dict,
)

__all__ = [
    "CaptureExtractionError",
    "ClientWants",
    "Completion",
    "ForwardPlan",
    "ReasoningField",
    "StreamAccumulator",
    "UpstreamProtocolError",
    "VLLMAdapter",
    "parse_error_body",
]


class VLLMAdapter:
    """Speaks vLLM's OpenAI-compatible chat API (vLLM 0.32, see docs/upstream-facts.md).

    `reasoning_field` is the name vLLM reads replayed reasoning under: ``reasoning_content``
    (default; vLLM <= 0.15 and >= 0.22) or ``reasoning`` (vLLM 0.16-0.21 read only that).

    Answers parsed with a `session` (the rollout id) leave their prompt + completion in
    `prefixes`, a cache bounded by `prefix_cache_bytes`: the session's next prompt starts with
    them, and only its new tokens are decoded (`_ids.decode_prompt`; exact either way).
    """

    __slots__ = ("prefixes", "reasoning_field")

    def __init__(
        self,
        *,
        reasoning_field: ReasoningField = "reasoning_content",
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ) -> None:
        if reasoning_field not in ("reasoning_content", "reasoning"):
            raise ValueError(f"unknown reasoning field {reasoning_field!r}")
        self.reasoning_field: ReasoningField = reasoning_field
        self.prefixes = PrefixCache(prefix_cache_bytes)

    def plan(
        self, request: dict[str, Any], *, routed_experts_prompt_start: int | None = None
    ) -> ForwardPlan:
        """The bytes to forward for a normalized, validated request (which is not modified).

        Adds ``return_token_ids: true``, ``logprobs: true`` and ``top_logprobs`` (the client's
        value if it asked for logprobs, else 0); on streams ``stream_options.include_usage: true``.
        ``return_tokens_as_token_ids`` is left as the client sent it: it rewrites the logprob
        tokens the client sees. `routed_experts_prompt_start` is sent when given and the client
        did not send one itself: the routed experts of the positions before it are staged
        already (with an earlier call), so vLLM need not return them again.
        """
        stream = request.get("stream") is True
        client_logprobs = request.get("logprobs") is True
        top = request.get("top_logprobs")
        top_logprobs = top if isinstance(top, int) and not isinstance(top, bool) else None
        stream_options = request.get("stream_options")
        opts: dict[str, Any] = dict(stream_options) if isinstance(stream_options, dict) else {}
        wants = ClientWants(
            stream=stream,
            logprobs=client_logprobs,
            top_logprobs=top_logprobs,
            usage=(opts.get("include_usage") is True) if stream else True,
            token_ids=request.get("return_token_ids") is True,
            token_id_strings=request.get("return_tokens_as_token_ids") is True,
            continuous_usage=stream
            and opts.get("include_usage") is True
            and opts.get("continuous_usage_stats") is True,
        )
        body = dict(request)
        body["return_token_ids"] = True
        body["logprobs"] = True
        body["top_logprobs"] = top_logprobs if client_logprobs and top_logprobs else 0
        if routed_experts_prompt_start is not None and "routed_experts_prompt_start" not in body:
            body["routed_experts_prompt_start"] = routed_experts_prompt_start
        if stream:
            opts["include_usage"] = True
            body["stream_options"] = opts
        if self.reasoning_field == "reasoning" and "messages" in request:
            body["messages"] = _rename_reasoning(request["messages"])
        return ForwardPlan(orjson.dumps(body), wants)

    def parse_response(
        self, raw: bytes, plan: ForwardPlan, *, session: str | None = None
    ) -> tuple[Completion, bytes]:
        """Extract a non-streamed answer; returns ``(completion, client_body)``.

        `session` names the rollout the call belongs to (see the class docs); without it the
        prompt ids are decoded in full.

        Raises `UpstreamProtocolError` when the answer is broken (malformed JSON, an error body,
        no choices, no finish reason) and `CaptureExtractionError` when it is fine for the client
        but cannot be staged exactly; that error's ``client_body`` holds the body to relay.
        """
        fast = read_answer(raw, plan.wants)
        if fast is not None:
            top, choices, client_body = fast.top, [fast.choice], fast.client_body
            typed: tuple[Logprobs | None, list[int]] | None = (fast.logprobs, fast.token_ids)
        else:
            top, choices = _top_and_choices(raw)
            client_body = _client_body(raw, top, choices, plan.wants)
            typed = None
        prompt_raw = bytes(top.get("prompt_token_ids", NULL))
        try:
            prompt = decode_prompt("prompt_token_ids", prompt_raw, self.prefixes.get(session))
            completion = _extract(top, choices, prompt, typed)
        except CaptureExtractionError as exc:
            exc.client_body = client_body
            raise
        except msgspec.DecodeError as exc:
            raise UpstreamProtocolError("malformed_json", f"response body: {exc}") from exc
        self.prefixes.put(
            session, prompt_raw, completion.prompt_token_ids, completion.completion_token_ids
        )
        return completion, client_body

    def stream(self, plan: ForwardPlan, *, session: str | None = None) -> StreamAccumulator:
        """A sans-IO accumulator for the streamed answer to `plan` (`session`: as above)."""
        return StreamAccumulator(plan.wants, prefixes=self.prefixes, session=session)

    @staticmethod
    def parse_error_body(raw: bytes, status: int) -> dict[str, Any]:
        """An OpenAI error body for an upstream error answer; see `parse_error_body`."""
        return parse_error_body(raw, status)


def _rename_reasoning(messages: Any) -> Any:
    """Messages with assistant ``reasoning_content`` renamed ``reasoning`` (copies what changes)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant" and "reasoning_content" in m:
            m = {("reasoning" if k == "reasoning_content" else k): v for k, v in m.items()}
        out.append(m)
    return out


def _top_and_choices(raw: bytes) -> tuple[RawDict, list[RawDict]]:
    """The generic read: the top level and the choices as raw values; refuses broken answers."""
    try:
        top = decode_object(raw)
        choices = decode_choices(top["choices"]) if "choices" in top else None
    except msgspec.DecodeError as exc:
        raise UpstreamProtocolError("malformed_json", f"response body: {exc}") from exc
    if choices is None:
        if "error" in top or "message" in top:
            body = parse_error_body(raw, 200)
            raise UpstreamProtocolError("error_body", body["error"]["message"], error_body=body)
        raise UpstreamProtocolError("no_choices", "the response has no choices")
    if not choices:
        raise UpstreamProtocolError("no_choices", "the response has an empty choices list")
    return top, choices


def _client_body(raw: bytes, top: RawDict, choices: list[RawDict], wants: ClientWants) -> bytes:
    body = strip_for_client(top, choices, wants)
    # Nothing to strip: forward vLLM's bytes as they are (never re-encode what can be relayed).
    return raw if body is None else encode(body)


def _extract(
    top: RawDict,
    choices: list[RawDict],
    prompt: array[int] | None,
    typed: tuple[Logprobs | None, list[int]] | None,
) -> Completion:
    """The completion from raw values; `typed`: logprobs and ids the fast path decoded."""
    if len(choices) > 1:
        raise CaptureExtractionError(
            "multiple_choices", f"{len(choices)} choices; a record holds exactly one"
        )
    choice = choices[0]
    finish_reason = decode_str(choice.get("finish_reason", NULL))
    if not finish_reason:
        raise UpstreamProtocolError("missing_finish_reason", "choices[0] has no finish_reason")
    message = decode_message(choice.get("message", EMPTY_OBJECT))
    ids: list[int] | None
    if typed is not None:
        logprobs, ids = typed
    else:
        logprobs = decode_logprobs(choice.get("logprobs", NULL))
        ids = decode_ids(choice.get("token_ids", NULL))
    entries = logprobs.content if logprobs is not None and logprobs.content is not None else []
    if ids is None:
        ids = ids_from_logprob_tokens(entries) if entries else None
        if ids is None:
            raise CaptureExtractionError(
                "missing_token_ids",
                "choices[0] has no token_ids and its logprob tokens are not 'token_id:N'",
            )
    completion = to_ids("completion_token_ids", ids)
    lps = array("f", [e.logprob for e in entries])
    usage = decode_usage(top.get("usage", NULL))
    prompt, usage = check_counts(prompt, completion, lps, usage)
    response_id = decode_str(top.get("id", NULL)) or ""
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    tool_calls = [normalize_tool_call(tc) for tc in message.tool_calls or ()]
    stop_reason = decode_stop_reason(choice.get("stop_reason", NULL))
    media_spans = choice.get("media_spans", top.get("media_spans", NULL))
    return Completion(
        response_id=response_id,
        model=decode_str(top.get("model", NULL)) or "",
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=lps,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        message=build_message(message.content, reasoning, tool_calls),
        usage=usage_dict(usage),
        extras=make_extras(
            response_id,
            decode_str(top.get("system_fingerprint", NULL)),
            stop_reason,
            decode_any(choice.get("routed_experts", NULL)),
            decode_any(media_spans),
        ),
    )
