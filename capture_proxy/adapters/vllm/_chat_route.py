"""What vLLM's chat route does to a generation that derender does not (sans-IO).

A token-in answer is built by derender (``/v1/chat/completions/derender``) from generate's ids;
the client and the record must get what the chat route gives for the same ids. vLLM 0.32's
derender differs from the chat route in these ways (docs/upstream-facts.md, "Token-in routes",
measured; DESIGN §11), each undone here:

- **The stop token's text.** The chat route never detokenizes the token a completion stopped on
  (end of sequence or a ``stop_token_ids`` id) unless ``include_stop_str_in_output``
  (``vllm/v1/engine/detokenizer.py``, ``update``). Derender decodes it with special tokens kept
  for its parsers; its streamed route then leaves ``<|im_end|>`` in the content when that token
  comes in a chunk of its own. `StopTokenStrip` takes the stop token out of a streamed call's
  last ``generate_chunk`` before derender sees it (the engine's own rule), and puts its id back
  into the chunk's ``token_ids`` afterwards.
- **Stop strings.** Generate stops on a ``stop`` string, but derender does not cut the text:
  `StopCut` cuts content (or reasoning, when the stop came there) as the chat route does
  (``check_stop_strings``: at the stop string, or after it with ``include_stop_str_in_output``).
- **The finish reason of a streamed tool call cut short.** Derender's streamed chunks say
  ``"tool_calls"`` for any finish once a tool call streamed; the chat route says so only for a
  ``"stop"`` (`StopTokenStrip.restore` gives back generate's ``"length"``).
- **Tool call ids and logprob strings.** Derender's unary tool call ids are bare 16 hex
  (`chat_tool_id` gives the chat route's ``chatcmpl-tool-`` form); its logprobs ignore
  ``return_tokens_as_token_ids`` and ``top_logprobs`` (`chat_logprobs`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ._generate import Generated
from ._wire import ClientWants, UpstreamProtocolError

__all__ = [
    "CHAT_TOOL_ID_PREFIX",
    "REASONING_MARKERS",
    "StopCut",
    "StopTokenStrip",
    "chat_finish_reason",
    "chat_logprobs",
    "chat_tool_id",
    "chat_usage",
    "count_reasoning_tokens",
    "counts_reasoning_from_start",
    "rewrites_logprobs",
    "without_stop_token_id",
]

#: The texts of the markers `count_reasoning_tokens` reads: the reasoning start and end of vLLM's
#: think-style reasoning parsers (Qwen3, DeepSeek-R1, ...), and the Qwen3 parser's tool call
#: start, which ends the reasoning too.
REASONING_MARKERS = ("<think>", "</think>", "<tool_call>")


def count_reasoning_tokens(
    ids: Sequence[int], markers: tuple[int, int, int | None], *, open_at_start: bool
) -> int:
    """The completion's reasoning tokens as vLLM 0.32's Qwen3 parser counts them for the chat
    route's ``completion_tokens_details`` (its parser engine's count of the tokens it read in
    the reasoning phase). `markers`: the ids of ``<think>``, ``</think>`` and ``<tool_call>``
    (None when not one token). The phase is open at the start unless thinking is off
    (`counts_reasoning_from_start`) and never opens later (the parser's grammar has no way back
    into it); ``</think>`` or a ``<tool_call>`` ends it (``qwen3_config``'s transitions: a tool
    call is an implicit end); ``<think>`` inside it is not counted. Measured against the chat
    route on the tiny vLLM (tests/e2e/test_vllm_parity.py: reasoning cut by length counts every
    token, an answer whose first token closes the reasoning counts none, a tool call straight
    after a continued message none)."""
    start, end, tool = markers
    if not open_at_start:
        return 0
    count = 0
    for token in ids:
        if token in (end, tool):
            break
        if token != start:
            count += 1
    return count


def counts_reasoning_from_start(reasoning_parser_kwargs: Any) -> bool:
    """Whether the chat route's reasoning count starts in the reasoning phase, from render's
    ``reasoning_parser_kwargs`` (parsed JSON): the Qwen3 parser's config starts there unless
    ``chat_template_kwargs.enable_thinking`` is falsy, and its count never reads the prompt
    (vLLM 0.32 ``parser/engine/adapters.py``, ``count_reasoning_tokens``: a fresh parser engine
    in its initial state, unary and streamed alike once the prompt ended the reasoning). So a
    continued assistant message whose reasoning closed counts its answer as reasoning."""
    kwargs = (
        reasoning_parser_kwargs.get("chat_template_kwargs")
        if isinstance(reasoning_parser_kwargs, Mapping)
        else None
    )
    if not isinstance(kwargs, Mapping):
        return True
    return bool(kwargs.get("enable_thinking", True))


def chat_usage(
    counts: Mapping[str, Any], *, stream: bool, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """Generate's counts in the chat route's ``usage`` shape (tests/fixtures/vllm-0.32.0/
    chat-response.json, chat-stream.sse): the streamed one has no ``prompt_tokens_details``;
    ``completion_tokens_details`` when `reasoning_tokens` is given (a server with a reasoning
    parser, whose marker ids are known: docs/token-in.md, "What the agent gets")."""
    prompt = int(counts.get("prompt_tokens") or 0)
    completion = int(counts.get("completion_tokens") or 0)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if not stream:
        usage["prompt_tokens_details"] = None
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def chat_finish_reason(derendered: str | None, generated: str | None) -> str | None:
    """The finish reason the chat route gives: ``"tool_calls"`` only where generate stopped
    (``"length"`` stays ``"length"`` however the answer parsed)."""
    if derendered == "tool_calls" and generated not in (None, "stop"):
        return generated
    return derendered


@dataclass(frozen=True, slots=True)
class StopCut:
    """The request's ``stop`` strings and how the chat route cuts at them."""

    stops: tuple[str, ...]
    include: bool
    min_tokens: int

    @classmethod
    def of(cls, request: Mapping[str, Any]) -> StopCut | None:
        """The rule of a Chat Completions request, None when it has no stop strings."""
        stop = request.get("stop")
        stops = (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if s)
        if not stops or not all(isinstance(s, str) for s in stops):
            return None
        min_tokens = request.get("min_tokens")
        return cls(
            stops,
            request.get("include_stop_str_in_output") is True,
            min_tokens if type(min_tokens) is int else 0,
        )

    @property
    def hold(self) -> int:
        """Characters a stream holds back until the end (the chat route's stop buffer)."""
        return 0 if self.include else max(len(s) for s in self.stops) - 1

    def cut(self, text: str, stop_reason: object) -> str | None:
        """`text` cut at the stop string generate stopped on (`stop_reason`), None when the
        text does not hold it (the stop came in another field).

        Without ``min_tokens`` the first occurrence is the one: generate checks after every token,
        so an earlier one would have stopped it earlier. With ``min_tokens`` the checks start late,
        and the last occurrence is taken (wrong only for a last token holding it twice)."""
        if not isinstance(stop_reason, str) or not stop_reason:
            return None
        at = text.rfind(stop_reason) if self.min_tokens else text.find(stop_reason)
        if at < 0:
            return None
        return text[: at + len(stop_reason)] if self.include else text[:at]

    def cut_message(self, message: MutableMapping[str, Any], stop_reason: object) -> bool:
        """Cut an assistant message in place (content first, else reasoning); True if it
        changed."""
        for key in ("content", "reasoning", "reasoning_content"):
            text = message.get(key)
            if not isinstance(text, str):
                continue
            cut = self.cut(text, stop_reason)
            if cut is None:
                continue
            if cut == text:
                return False
            message[key] = cut or (None if key == "content" else "")
            if key != "content" and not message[key]:
                message[key] = None
            return True
        return False


def without_stop_token_id(generate_answer: bytes, include_stop_str: bool) -> tuple[bytes, bool]:
    """Generate's unary answer as derender should get it: without the ``stop_token_ids`` id the
    generation stopped on, which the chat route does not decode (measured: the unary derender
    gives a plain stop token's text, ``"\n"``, where the chat route gives none). An end of
    sequence (``stop_reason`` null) stays: the unary derender skips it as a special token.
    Also whether that id was the whole completion: derender refuses no ids, so the answer goes
    as it came and its text is to be dropped (`Derendered.without_text`)."""
    # vLLM writes `stop_reason` early in the answer (before the ids and logprobs), without
    # spaces: only an answer whose stop reason is a number is decoded.
    at = generate_answer.find(b'"stop_reason":')
    after = generate_answer[at + 14 : at + 15] if at >= 0 else b""
    if include_stop_str or not after.isdigit():
        return generate_answer, False
    try:
        data = orjson.loads(generate_answer)
        [choice] = data["choices"]
        ids = choice["token_ids"]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return generate_answer, False  # read_generate says what is wrong with it
    if choice.get("finish_reason") != "stop" or type(choice.get("stop_reason")) is not int:
        return generate_answer, False
    if not isinstance(ids, list) or not ids:
        return generate_answer, False
    if len(ids) == 1:
        return generate_answer, True
    choice["token_ids"] = ids[:-1]
    return orjson.dumps(data), False


class StopTokenStrip:
    """A streamed call's last ``generate_chunk`` without the token it stopped on (module docs).

    `strip(chunk)` gives the chunk to send to derender (the same bytes unless it is the last one
    and ended on a stop token); `restore(answer)` puts the chat route's finish reason and the
    stripped id back into derender's answer for that chunk.
    """

    def __init__(self, include_stop_str: bool) -> None:
        self._keep = include_stop_str
        self._stripped: int | None = None
        self._finish: str | None = None

    def strip(self, chunk: bytes) -> bytes:
        self._stripped = None
        self._finish = None
        if b'"finish_reason":null' in chunk or b'"finish_reason"' not in chunk:
            return chunk  # not the last chunk (vLLM writes JSON without spaces)
        data = orjson.loads(chunk)
        choices = data.get("choices") or []
        if len(choices) != 1:
            return chunk
        choice = choices[0]
        self._finish = choice.get("finish_reason")
        ids = choice.get("token_ids")
        stopped_on_token = self._finish == "stop" and not isinstance(choice.get("stop_reason"), str)
        if self._keep or not stopped_on_token or not ids:
            return chunk
        # The chat route never decodes this token (vLLM's detokenizer `update`); its logprobs
        # stay (derender resolves each entry by its own id).
        self._stripped = ids[-1]
        choice["token_ids"] = ids[:-1]
        return orjson.dumps(data)

    def restore(self, answer: MutableMapping[str, Any]) -> None:
        chunk = answer.get("chunk") or {}
        for choice in chunk.get("choices") or ():
            if self._finish is not None:
                choice["finish_reason"] = chat_finish_reason(
                    choice.get("finish_reason"), self._finish
                )
            ids = choice.get("token_ids")
            if self._stripped is not None and isinstance(ids, list):
                ids.append(self._stripped)


#: What the chat route's tool call ids start with (vLLM's ``make_tool_call_id``).
CHAT_TOOL_ID_PREFIX = "chatcmpl-tool-"
_HEX = frozenset("0123456789abcdef")
_TOKEN_ID = "token_id:"


def chat_tool_id(tool_id: object) -> object:
    """The chat route's form of a unary derender answer's tool call id: vLLM's bare 16-hex
    ``random_uuid()`` gets the ``chatcmpl-tool-`` the chat route writes before it; any other id
    is kept."""
    if isinstance(tool_id, str) and len(tool_id) == 16 and set(tool_id) <= _HEX:
        return CHAT_TOOL_ID_PREFIX + tool_id
    return tool_id


def chat_logprobs(
    entries: list[dict[str, Any]],
    generated: Generated | None,
    start: int,
    wants: ClientWants,
) -> None:
    """Rewrite derender's logprobs `entries` in place as the chat route writes them for what
    the client asked (module docs): at most ``top_logprobs`` top entries each (derender gives
    every alternative generate sampled, the sampled token's own with ``top_logprobs`` 0); with
    ``return_tokens_as_token_ids`` entry k, completion position ``start + k``, has ``token``
    ``"token_id:N"`` for `generated`'s id there, and each top entry the ``token`` and ``bytes``
    of ``"token_id:N"`` for generate's top id at its rank (the entry's own ``bytes`` stay its
    decoded text's, as vLLM's chat route keeps them).

    Raises `UpstreamProtocolError` (``logprobs_mismatch``) when the ids to write are unknown:
    derender gave more entries, or more top entries at a position, than generate sampled."""
    top = wants.top_logprobs or 0
    for entry in entries:
        alts = entry.get("top_logprobs")
        if isinstance(alts, list) and len(alts) > top:
            del alts[top:]
    if not wants.token_id_strings:
        return
    ids = generated.completion_ids if generated is not None else ()
    tops = generated.top_logprobs if generated is not None else None
    if start + len(entries) > len(ids):
        raise UpstreamProtocolError(
            "logprobs_mismatch",
            f"derender gave logprobs for positions {start}..{start + len(entries) - 1}, "
            f"generate sampled {len(ids)} tokens",
        )
    for k, entry in enumerate(entries):
        i = start + k
        entry["token"] = f"{_TOKEN_ID}{ids[i]}"
        alts = entry.get("top_logprobs") or ()
        row = tops[i] if tops is not None and i < len(tops) else ()
        if len(alts) > len(row):
            raise UpstreamProtocolError(
                "logprobs_mismatch",
                f"derender gave {len(alts)} top logprobs at position {i}, generate {len(row)}",
            )
        for alt, (alt_id, _) in zip(alts, row, strict=False):
            text = f"{_TOKEN_ID}{alt_id}"
            alt["token"] = text
            alt["bytes"] = list(text.encode())


def rewrites_logprobs(generated: Generated, wants: ClientWants) -> bool:
    """Whether `chat_logprobs` changes a unary answer's logprobs (else they are spliced as
    they came, never decoded)."""
    if not wants.logprobs:
        return False
    top = wants.top_logprobs or 0
    rows = generated.top_logprobs or ()
    return wants.token_id_strings or any(len(row) > top for row in rows)
