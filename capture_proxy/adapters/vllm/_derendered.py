"""A token-in call's answer as the client gets it: derender's Chat Completions answer, shaped by
the relay rules of the chat route (sans-IO).

Derender (``POST /v1/chat/completions/derender``) builds a ``chat.completion`` (or, streamed, one
``chat.completion.chunk`` per call) from generate's ids, reasoning and tool calls parsed by vLLM's
own parsers. Its answer differs from the chat route's in what it cannot know; the client gets
what the chat route would have sent:

- ``usage`` is generate's (derender counts no prompt: its ``prompt_tokens`` is 0);
- a unary answer with tool calls has ``finish_reason`` ``"tool_calls"`` (derender's unary answer
  keeps generate's ``"stop"``; its streamed chunks already say ``"tool_calls"``), but for a
  named ``tool_choice``, where the chat route says ``"stop"``;
- a unary answer's tool call ids are the chat route's ``chatcmpl-tool-<16 hex>``: derender's
  unary answer gives vLLM's bare 16-hex ``random_uuid()`` (vLLM 0.32
  ``vllm/renderers/online_derenderer.py``), the chat route ``make_tool_call_id()``, the same
  random part behind ``chatcmpl-tool-`` (its streamed chunks already do);
- each logprob entry has at most ``top_logprobs`` top entries (none without it: derender gives
  the sampled token's own); with ``return_tokens_as_token_ids: true`` each entry's ``token`` is
  ``"token_id:N"`` and each top entry's ``token`` and ``bytes`` are those of ``"token_id:N"``
  (the entry's own ``bytes`` stay its decoded text's), as the chat route writes them: derender
  does not read that key, and the ids are generate's, position by position (`chat_logprobs`);
- the rules of `capture_proxy.adapters.vllm`'s module docs: ``prompt_token_ids``,
  ``prompt_text`` and ``token_ids`` only when the client sent ``return_token_ids: true`` (then
  the ids the call sent and generated), ``logprobs`` null unless the client sent ``logprobs:
  true``, ``routed_experts`` removed, the null ``prompt_logprobs`` / transfer params removed, the
  usage-only chunk of a stream only when the client asked for usage.

A unary answer is read once (`read_derendered`): its values stay the JSON they came as and the
client's answer splices them (the per-token logprobs, most of the answer, are never decoded);
only the message is decoded, for the record and the finish reason.

`DerenderedStream` also puts the streamed message together (content, reasoning, tool calls) for
the record, as `to_completion` reads it from a unary answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from ._chat_route import StopCut, chat_logprobs, chat_tool_id, chat_usage, rewrites_logprobs
from ._generate import Generated
from ._ids_json import encode_ids
from ._wire import (
    NULL_DROPPED_FIELDS,
    TOKEN_ID_FIELDS,
    ClientWants,
    UpstreamProtocolError,
    decode_choices,
    decode_object,
    is_null,
    strip_for_client,
)

__all__ = ["Derendered", "DerenderedStream", "client_answer", "read_derendered"]


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


_decode_message = msgspec.json.Decoder(dict[str, Any]).decode
_encode = msgspec.json.Encoder().encode
_STOP = b'"stop"'
_TOOL_CALLS = msgspec.Raw(b'"tool_calls"')


@dataclass(frozen=True, slots=True)
class Derendered:
    """A unary derender answer (a ``chat.completion``), read once by `read_derendered`.

    The top-level fields and each choice's stay the JSON they came as (`msgspec.Raw`): the client
    gets them spliced, never decoded (the per-token logprobs are most of the answer). Only each
    choice's ``message`` is decoded (`messages`): what the record and the relay rules read.
    """

    top: dict[str, msgspec.Raw]
    choices: list[dict[str, msgspec.Raw]]
    messages: list[dict[str, Any]]

    def cut_at_stop(self, stop: StopCut | None, stop_reason: object) -> Derendered:
        """The answer with its text cut at the stop string the generation stopped on, as the
        chat route cuts it (`StopCut`); itself when nothing is cut."""
        if stop is None or not isinstance(stop_reason, str):
            return self
        messages = [dict(m) for m in self.messages]
        choices = list(self.choices)
        changed = False
        for i, message in enumerate(messages):
            if stop.cut_message(message, stop_reason):
                changed = True
                choices[i] = {**choices[i], "message": msgspec.Raw(_encode(message))}
        return Derendered(self.top, choices, messages) if changed else self

    def without_text(self) -> Derendered:
        """The answer with no text: what the chat route gives a completion that is only the
        stop token it does not decode (`without_stop_token_id`)."""
        messages = [{**m, "content": None, "reasoning": None} for m in self.messages]
        for m in messages:
            m.pop("reasoning_content", None)
        choices = [
            {**c, "message": msgspec.Raw(_encode(m))}
            for c, m in zip(self.choices, messages, strict=True)
        ]
        return Derendered(self.top, choices, messages)

    def with_chat_logprobs(self, generated: Generated, wants: ClientWants) -> Derendered:
        """The answer with its logprobs as the chat route writes them for what the client
        asked (`chat_logprobs`); itself when that changes nothing. Raises
        `UpstreamProtocolError` as `chat_logprobs` does."""
        if not rewrites_logprobs(generated, wants):
            return self
        choices = list(self.choices)
        changed = False
        for i, choice in enumerate(choices):
            raw = choice.get("logprobs")
            if is_null(raw):
                continue
            assert raw is not None
            logprobs = _decode_message(raw)
            entries = logprobs.get("content")
            if not isinstance(entries, list) or not entries:
                continue
            chat_logprobs(entries, generated, 0, wants)  # one choice: `n > 1` is refused
            choices[i] = {**choice, "logprobs": msgspec.Raw(_encode(logprobs))}
            changed = True
        return Derendered(self.top, choices, self.messages) if changed else self

    def for_record(self) -> dict[str, Any]:
        """The answer as `to_completion` reads it: the first choice's message."""
        return {"choices": [{"message": self.messages[0]}]} if self.messages else {}


def read_derendered(raw: bytes) -> Derendered:
    """Read a unary derender answer (module docs); `UpstreamProtocolError` when it is not an
    object, its ``choices`` not a list of objects, or a ``message`` not an object."""
    try:
        top = decode_object(raw)
        choices = [] if is_null(top.get("choices")) else decode_choices(top["choices"])
        messages = [
            {} if is_null(c.get("message")) else _decode_message(c["message"]) for c in choices
        ]
        for i, message in enumerate(messages):
            calls = message.get("tool_calls")
            if not isinstance(calls, list) or not calls:
                continue
            for call in calls:
                if isinstance(call, dict) and "id" in call:
                    call["id"] = chat_tool_id(call["id"])
            choices[i] = {**choices[i], "message": msgspec.Raw(_encode(message))}
    except msgspec.ValidationError as exc:
        raise UpstreamProtocolError("malformed_json", f"the derender answer: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise UpstreamProtocolError("malformed_json", f"the derender answer: {exc}") from exc
    return Derendered(top, choices, messages)


def client_answer(
    derendered: Derendered | Mapping[str, Any],
    generated: Generated,
    prompt_ids: Sequence[int],
    wants: ClientWants,
    *,
    ids_json: bytes | None = None,
    reasoning_tokens: int | None = None,
    named_tool_choice: bool = False,
) -> bytes:
    """The unary answer for the client (JSON) from derender's answer (`read_derendered`'s, or
    decoded), the `generated` completion and the `prompt_ids` sent (module docs for what
    changes; `ids_json`: those ids already encoded; `named_tool_choice`: the request named the
    function in ``tool_choice``). Every value the client gets as derender wrote it is spliced
    in as it came."""
    if not isinstance(derendered, Derendered):
        derendered = read_derendered(orjson.dumps(derendered))
    top, choices = derendered.top, derendered.choices
    # The chat route's relay rules, as the plain path applies them (values kept as they came).
    body = strip_for_client(top, choices, wants)
    if body is None:
        body, shaped = dict(top), [dict(c) for c in choices]
    else:
        shaped = body.get("choices", [])
    for c, message in zip(shaped, derendered.messages, strict=True):
        finish = c.get("finish_reason")
        calls = message.get("tool_calls") and not named_tool_choice
        if calls and finish is not None and bytes(finish) == _STOP:
            c["finish_reason"] = _TOOL_CALLS
        if wants.token_ids:
            c["token_ids"] = msgspec.Raw(encode_ids(generated.completion_ids))
    body["choices"] = shaped
    if wants.token_ids:
        body["prompt_token_ids"] = msgspec.Raw(
            ids_json if ids_json is not None else encode_ids(prompt_ids)
        )
    counts = _usage(generated, len(prompt_ids))
    body["usage"] = chat_usage(counts, stream=False, reasoning_tokens=reasoning_tokens)
    return _encode(body)


class DerenderedStream:
    """Shapes a streamed token-in answer's chunks for the client and puts its message together.

    `feed` each derendered ``chat.completion.chunk`` (decoded) in order; it returns the SSE
    event to send (``data: ...``), or None for a chunk the client does not get. `message` is the
    assistant message so far, in the shape `to_completion` reads (``content``, ``reasoning``,
    ``tool_calls``).
    """

    def __init__(
        self,
        wants: ClientWants,
        prompt_ids: Sequence[int],
        stop: StopCut | None = None,
        reasoning_tokens: Callable[[], int | None] | None = None,
        generated: Callable[[], Generated | None] | None = None,
        running_reasoning: Callable[[int], int | None] | None = None,
    ) -> None:
        self._wants = wants
        #: The reasoning tokens among the completion's first n, for a running usage.
        self._running_reasoning = running_reasoning
        #: How many completion ids the chunks so far carried (a running usage counts them).
        self._ids = 0
        #: The generation read so far, for ``"token_id:N"`` logprobs (`chat_logprobs`).
        self._generated = generated
        #: The completion position of the next logprobs entry.
        self._logprob_at = 0
        #: The completion's reasoning tokens so far, for the usage chunk (None: not given).
        self._reasoning_tokens = reasoning_tokens
        self._prompt_ids = prompt_ids
        self._first = True
        self._stop = stop
        #: Per text field: everything derender streamed, and what the client got of it.
        self._text: dict[str, str] = {"content": "", "reasoning": ""}
        self._sent: dict[str, str] = {"content": "", "reasoning": ""}
        self._tools: dict[int, dict[str, Any]] = {}
        #: With stop strings: each tool call's arguments the client got (`_release_tools`).
        self._sent_args: dict[int, str] = {}

    def feed(self, chunk: Mapping[str, Any]) -> bytes | None:
        """The client's event for `chunk` (class docs). Raises `UpstreamProtocolError` when its
        logprobs cannot be written as ``"token_id:N"`` (`chat_logprobs`)."""
        choices = chunk.get("choices") or []
        finished = False
        for choice in choices:
            self._count_ids(choice)
            finished = finished or choice.get("finish_reason") is not None
            self._logprobs(choice)
            delta = choice.get("delta") or {}
            self._take(delta)
            self._release(delta, choice.get("finish_reason"), choice.get("stop_reason"))
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
            counts = {"prompt_tokens": prompt, "completion_tokens": n}
            reasoning = self._reasoning_tokens() if self._reasoning_tokens is not None else None
            out["usage"] = chat_usage(counts, stream=True, reasoning_tokens=reasoning)
        elif choices and self._wants.continuous_usage:
            out["usage"] = self._running_usage(finished)
        if self._first and self._wants.token_ids:
            out["prompt_token_ids"] = list(self._prompt_ids)
        self._first = False
        return b"data: " + orjson.dumps(out) + b"\n\n"

    def _count_ids(self, choice: Mapping[str, Any]) -> None:
        """Count the completion ids a chunk carries: its ``token_ids`` (the proxy's chat request
        asks derender for them), else every id generate streamed so far."""
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self._ids += len(ids)
            return
        generated = self._generated() if self._generated is not None else None
        if generated is not None:
            self._ids = len(generated.completion_ids)

    def _running_usage(self, finished: bool) -> dict[str, Any]:
        """The usage the chat route puts on every chunk with ``continuous_usage_stats``: the
        counts through this chunk (the reasoning count of the last chunk as the usage chunk's)."""
        counts = {"prompt_tokens": len(self._prompt_ids), "completion_tokens": self._ids}
        reasoning = None
        if finished and self._reasoning_tokens is not None:
            reasoning = self._reasoning_tokens()
        elif self._running_reasoning is not None:
            reasoning = self._running_reasoning(self._ids)
        return chat_usage(counts, stream=True, reasoning_tokens=reasoning)

    def _logprobs(self, choice: Mapping[str, Any]) -> None:
        """A chunk's logprobs as the chat route writes them (`chat_logprobs`; entries follow
        each other through the stream, one per completion position)."""
        logprobs = choice.get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        if not self._wants.logprobs or not isinstance(entries, list) or not entries:
            return
        generated = self._generated() if self._generated is not None else None
        chat_logprobs(entries, generated, self._logprob_at, self._wants)
        self._logprob_at += len(entries)

    def _release(self, delta: dict[str, Any], finish: object, stop_reason: object) -> None:
        """Give the client the text the chat route would have sent by now: all of it, or,
        with stop strings, all but the last characters that could start one (the chat route's
        stop buffer), cut at the stop string at the end (`StopCut`)."""
        stop, text = self._stop, self._text
        if stop is None:
            self._sent = dict(text)
            return
        if finish is not None:
            final: dict[str, Any] = dict(text)
            stop.cut_message(final, stop_reason)
            ready = {k: final[k] or "" for k in text}
            held = {k: text[k] != ready[k] for k in text}
            self._release_tools(delta, stop, stop_reason if not any(held.values()) else None)
        else:
            # Reasoning is over once content or a tool call came: none of it can be cut then.
            over = bool(text["content"] or self._tools)
            hold = stop.hold
            ready = {
                k: v if not hold or (k == "reasoning" and over) else v[: max(0, len(v) - hold)]
                for k, v in text.items()
            }
            self._release_tools(delta, stop, None, held_back=hold)
        for key, value in ready.items():
            sent = self._sent[key]
            piece = value[len(sent) :] if value.startswith(sent) else ""
            field = key
            if key == "reasoning" and "reasoning" not in delta and "reasoning_content" in delta:
                field = "reasoning_content"
            if piece or delta.get(field) is not None:
                delta[field] = piece or None
            self._sent[key] = sent + piece

    def _release_tools(
        self, delta: dict[str, Any], stop: StopCut, stop_reason: object, held_back: int = 0
    ) -> None:
        """The tool calls' arguments the chat route would have streamed by now, with stop
        strings: vLLM cuts the text its tool parser reads, so the last call's arguments are held
        back by `held_back` characters (the stop buffer) while the stream runs and, at its end,
        cut at the stop string generate stopped on (`stop_reason`; None: it came elsewhere)."""
        if not self._tools:
            return
        last = max(self._tools)
        pieces: dict[int, str] = {}
        for index, slot in self._tools.items():
            args = slot["function"]["arguments"]
            ready = args
            if index == last and held_back:
                ready = args[: max(0, len(args) - held_back)]
            elif index == last and stop_reason is not None:
                cut = stop.cut(args, stop_reason)
                ready = args if cut is None else cut
            sent = self._sent_args.get(index, "")
            pieces[index] = ready[len(sent) :] if ready.startswith(sent) else ""
            self._sent_args[index] = sent + pieces[index]
        calls = delta.get("tool_calls")
        listed = calls if isinstance(calls, list) else []
        for tc in listed:
            fn = tc.get("function")
            index = int(tc.get("index") or 0)
            if isinstance(fn, dict) and (fn.get("arguments") is not None or pieces.get(index)):
                fn["arguments"] = pieces.pop(index, "")
        missing = [
            {"index": i, "function": {"arguments": piece}} for i, piece in pieces.items() if piece
        ]
        if missing:
            delta["tool_calls"] = [*listed, *missing]

    def _take(self, delta: Mapping[str, Any]) -> None:
        if delta.get("content"):
            self._text["content"] += delta["content"]
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            self._text["reasoning"] += reasoning
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
            "content": self._sent["content"] or None,
            "reasoning": self._sent["reasoning"] or None,
            "tool_calls": [self._tool_call(i) for i in sorted(self._tools)],
        }

    def _tool_call(self, index: int) -> dict[str, Any]:
        call = self._tools[index]
        if self._stop is None:
            return call
        function = {**call["function"], "arguments": self._sent_args.get(index, "")}
        return {**call, "function": function}
