"""A steady call's appended tokens read from the request's own rendering, without dummy renders
(docs/token-in.md, "A steady call without dummy renders").

The request's own rendering (the plain render every token-in call makes) ends with the turn close
after the replayed answer, the appended messages' tokens and the generation prompt: exactly the
tokens a bridged prompt needs after the model's completion. What the dummy renders add is where
those tokens start. The rendering shows it in two cases:

- **The answer rendered as sampled** (`_after_as_sent`): the rendering starts with the previous
  prompt and completion, id for id, then the part of the turn close the bridge adds after that
  completion. What follows is what the template writes after the answer.
- **Counted by the end-of-sequence token** (`_after_counted`), when the template re-renders the
  answer otherwise (Qwen3 drops its reasoning once a user message follows). The turn close holds
  the model's end-of-sequence token ``s``, learnt from a completion that stopped on it (vLLM's
  ``stop_reason`` null: the tokenizer's own end of sequence, a special token no text makes except
  by spelling it). From the front: the ids the rendering shares byte for byte with the previous
  prompt (`Rendered.known_prefix`) hold the same ``s`` tokens; the answer's close holds the next
  one. From the back: what follows holds exactly the ``s`` count the dummy renders showed for the
  same shape of appended messages (`shape_key`), learnt on a call that made them and whose
  dummy-read place agreed with the count from the front (`learnt_count`).

A history whose rendering gained or lost an ``s`` (a message that spells it, a template that
closes a turn only for some contents) moves the place the front count finds, and the count behind
it is then not the shape's: such a call makes the dummy renders, which decide as before. So does a
call whose answer is rendered otherwise before ``s`` or the shape is learnt, and one whose
appended messages have images.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...adapters.vllm import Rendered
from ._assemble import close_after, common_suffix, extended
from ._caches import CloseRenders
from ._media import media_parts
from ._values import Bridged, BridgePlan, Extension, NotBridged, Prior

__all__ = [
    "Steady",
    "eos_in_close",
    "from_rendering",
    "learn_shape",
    "learnt_count",
    "shape_key",
    "steady_plan",
]


def eos_in_close(prior: Prior, close: Sequence[int]) -> int | None:
    """Where in `close` the end-of-sequence token the previous completion stopped on sits (its
    first place, as the bridge puts it), or None: the completion did not stop on the model's
    end of sequence (cut by ``length``, a stop string, a request's stop token id), the token is
    not the close's, or the completion holds it before its end too."""
    completion = prior.completion_ids
    if not completion or prior.finish_reason not in ("stop", "tool_calls"):
        return None
    if prior.stop_reason is not None:
        return None
    s = completion[-1]
    at = next((i for i, t in enumerate(close) if t == s), None)
    if at is None or completion.count(s) != 1:
        return None
    return at


def shape_key(close_key: str, request: Mapping[str, Any], extension: Extension) -> str | None:
    """What the ``s`` count after the replayed answer can depend on: the template (`close_key`),
    whether the answer has tool calls, the generation keys, and each appended message's role,
    keys and kind of content. None when an appended message has images (their placement is read
    from the dummy renders)."""
    if media_parts(extension.appended):
        return None
    shapes = []
    for message in extension.appended:
        content = message.get("content")
        if isinstance(content, list):
            kind = ",".join(str(p.get("type")) if isinstance(p, Mapping) else "?" for p in content)
        else:
            kind = type(content).__name__
        shapes.append(f"{message.get('role')}:{','.join(sorted(message))}:{kind}:{bool(content)}")
    calls = bool(extension.replayed.get("tool_calls"))
    generation = request.get("add_generation_prompt", True) is not False
    continued = bool(request.get("continue_final_message"))
    return f"{close_key}/{int(calls)}{int(generation)}{int(continued)}/{'|'.join(shapes)}"


def from_rendering(
    prior: Prior, close: Sequence[int], eos: int | None, count: int | None, rendered: Rendered
) -> Bridged | None:
    """The bridged prompt with the appended tokens read from the request's own rendering, or
    None when the rendering does not place them beyond doubt (module docs). `eos`: where the
    model's end-of-sequence token sits in `close` (None: not learnt); `count`: how many of it
    the shape's appended tokens hold (None: not learnt)."""
    placed = close_after(prior, close)
    if isinstance(placed, NotBridged):
        return None
    rest, reason = placed
    end = _after_as_sent(prior, rest, rendered)
    if end is None:
        if eos is None or count is None:
            return None
        end = _after_counted(prior, close, eos, rendered)
        if end is None or rendered.prompt_ids[end:].count(close[eos]) != count:
            return None
    prompt, spans, appended_start = extended(prior, rest, reason, rendered.prompt_ids[end:])
    return Bridged(prompt, spans, appended_start, prior.media or (), tuple(close))


def learnt_count(
    prior: Prior, close: Sequence[int], eos: int, got: Bridged, rendered: Rendered
) -> int | None:
    """On a call the dummy renders bridged and the request's own rendering confirmed: how many
    end-of-sequence tokens its appended tokens hold, when the place the dummies showed for the
    answer's close is the place counted from the front (`_after_counted`); None when they
    disagree (the shape keeps to the dummy renders)."""
    appended = len(got.prompt_ids) - got.appended_start
    end = len(rendered.prompt_ids) - appended
    if _after_counted(prior, close, eos, rendered) != end:
        return None
    return got.prompt_ids[got.appended_start :].count(close[eos])


def _after_as_sent(prior: Prior, rest: Sequence[int], rendered: Rendered) -> int | None:
    """Where the appended tokens start when the rendering begins with the previous prompt and
    completion exactly as the model had them, then the close's `rest`: the template wrote the
    replayed answer as it was sampled, and what it writes after the answer follows."""
    plain = rendered.prompt_ids
    head, completion = prior.prompt_ids, prior.completion_ids
    n = len(head) + len(completion)
    end = n + len(rest)
    if len(plain) < end or list(plain[n:end]) != list(rest):
        return None
    if list(plain[len(head) : n]) != list(completion):
        return None
    # The ids the render answer spelled as the previous prompt's JSON are its ids already.
    same = min(rendered.known_prefix, len(head))
    if list(plain[same : len(head)]) != list(head[same:]):
        return None
    return end


def _after_counted(prior: Prior, close: Sequence[int], eos: int, rendered: Rendered) -> int | None:
    """Where the appended tokens start, counted by the end-of-sequence token ``s`` = close[eos]:
    after the rendering's ``s`` that follows as many as the previous prompt holds (the shared
    prefix's are the same ids) and the close's tokens after it. None when the completion holds
    an ``s`` other than its last token, or the rendering has too few or not the close there."""
    s = close[eos]
    plain = rendered.prompt_ids
    head, completion = prior.prompt_ids, prior.completion_ids
    ended = bool(completion) and completion[-1] == s
    if completion.count(s) != int(ended):
        return None
    start = min(rendered.known_prefix, len(head))
    wanted = head[start:].count(s) + 1
    place = start - 1
    for _ in range(wanted):
        try:
            place = plain.index(s, place + 1)
        except ValueError:
            return None
    rest = list(close[eos + 1 :])
    end = place + 1 + len(rest)
    if list(plain[place + 1 : end]) != rest:
        return None
    return end


@dataclass(frozen=True, slots=True)
class Steady:
    """What a steady call reads its appended tokens with (`from_rendering`): the turn
    close, where the model's end of sequence sits in it and the count its shape showed (None:
    not learnt)."""

    close: tuple[int, ...]
    eos: int | None
    count: int | None


def steady_plan(
    closes: CloseRenders, bridge: BridgePlan, request: Mapping[str, Any], verdict: Extension
) -> Steady | None:
    """A `Steady` when this call may try without the dummy renders: its close
    cached, no images appended. A completion that stopped on its end of sequence shows where
    that token sits in the close (kept for the template)."""
    if not closes.steady:
        return None
    pair = closes.get(bridge.close_key)
    key = shape_key(bridge.close_key, request, verdict)
    if pair is None or key is None or list(pair[0]) == list(pair[1]):
        return None
    close = tuple(common_suffix(*pair))
    if not close:
        return None
    eos = eos_in_close(verdict.prior, close)
    if eos is not None:
        closes.learn_eos(bridge.close_key, eos)
    return Steady(close, closes.eos(bridge.close_key), closes.stop_count(key))


def learn_shape(
    closes: CloseRenders,
    request: Mapping[str, Any],
    verdict: Extension,
    close_key: str,
    got: Bridged,
    rendered: Rendered,
) -> None:
    """After a call the dummy renders bridged: what its shape's later calls read without
    them (`learnt_count`), once per shape, once the template's end of sequence is
    known."""
    key = shape_key(close_key, request, verdict)
    if key is None or closes.counts_learnt(key):
        return
    eos = eos_in_close(verdict.prior, got.close)
    if eos is not None:
        closes.learn_eos(close_key, eos)
    eos = closes.eos(close_key)
    if eos is not None:
        closes.learn_count(key, learnt_count(verdict.prior, got.close, eos, got, rendered))
