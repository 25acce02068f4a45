"""The bridged prompt from the renders (`assemble`), and where the plain one differs
(`divergence`).

The bridged prompt is the previous call's prompt ids, its completion ids exactly as sampled, the
part of the turn close the completion did not already end with, then the template's tokens for
the appended messages and the generation prompt:

- the turn close C is the common suffix of the two ``close`` renders (`common_suffix`);
- the turn's end T is C, or for an answer with tool calls the common suffix of the two ``turn``
  renders, which must end with C (a template that closes a tool-call turn with other tokens,
  as gpt-oss's ``<|call|>``, is not bridged);
- the appended tokens are what follows T at the start of the common suffix of the two
  ``suffix`` renders;
- a ``turn`` or ``suffix`` pair may be given as one render's ids after the dummy content
  (`AfterContent`): they stand for the pair's common suffix;
- a completion that stopped on a stop token (finish ``stop`` or ``tool_calls``, no stop string:
  its last id s is the end-of-turn token the model sampled) gets what follows s in C, at the
  first place s sits in C (``turn_close``): C[1:] for ChatML's ``<|im_end|>\n``, nothing for a
  Llama-2-style `` </s>`` whose space the model did not sample. A stop token C does not hold (the
  model ended on ``<|endoftext|>`` where the template closes with ``<|im_end|>``) is not bridged
  (``stopped_on_other_token``): which close the template would have written after it is unknown;
- any other completion (cut by ``length``, stopped by a stop string) overlaps C's start by k
  tokens, k as large as possible (0 unless it was cut inside C), and gets C[k:], recorded as
  added by the proxy (``end_of_turn_added``).

The appended messages' images are placed where the suffix renders put them, counted from the
end; the previous call's stay where they were (``Bridged.media``, ``_media``).

Renders without that structure (the two renders of a pair the same, no common close, a tool-call
turn that does not end with the close, a suffix that does not start with the turn's end) give
``NotBridged("template_not_bridgeable")``: the bridge never guesses.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from ...schemas.fields import BridgeSpan
from ._media import MediaItem, media_parts
from ._values import AfterContent, Bridged, BridgePlan, BridgeRenders, NotBridged, Prior, Renders

__all__ = [
    "END_OF_TURN_ADDED",
    "TURN_CLOSE",
    "assemble",
    "close_after",
    "common_suffix",
    "divergence",
    "extended",
]

#: `bridge_spans` reason: the template's tokens after the end-of-turn token the model sampled.
TURN_CLOSE = "turn_close"
#: `bridge_spans` reason: the whole turn close, for a completion that did not end on it.
END_OF_TURN_ADDED = "end_of_turn_added"


def common_suffix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """The longest common suffix of two token sequences."""
    n = 0
    limit = min(len(a), len(b))
    while n < limit and a[-1 - n] == b[-1 - n]:
        n += 1
    return list(a[len(a) - n :])


def assemble(prior: Prior, plan: BridgePlan, rendered: BridgeRenders) -> Bridged | NotBridged:
    """The bridged prompt for `plan`'s extension of `prior`, from the renders it asked for."""
    if plan.turn is not None and rendered.turn is None:
        raise ValueError("the plan asks for `turn` renders: pass them in BridgeRenders.turn")
    read: list[list[int]] = []
    for name, renders in (
        ("close", rendered.close),
        ("turn", rendered.turn),
        ("suffix", rendered.suffix),
    ):
        if renders is not None:
            after = _after_content(name, renders)
            if isinstance(after, NotBridged):
                return after
            read.append(after)
    close, tail = read[0], read[-1]
    if not close:
        return NotBridged(
            "template_not_bridgeable",
            "the two dummy renders share no closing tokens: the template writes nothing after "
            "an assistant turn's content",
        )
    end = close
    if plan.turn is not None:
        end = read[1]
        if end[len(end) - len(close) :] != close:
            return NotBridged(
                "template_not_bridgeable",
                "a turn with tool calls does not end with the turn close of one without",
            )
    if tail[: len(end)] != end:
        return NotBridged(
            "template_not_bridgeable",
            f"the rendering of the appended messages does not start with the turn's end "
            f"({len(end)} tokens)",
        )
    appended = tail[len(end) :]
    placed = close_after(prior, close)
    if isinstance(placed, NotBridged):
        return placed
    prompt, spans, appended_start = extended(prior, *placed, appended)
    media = _placed(prior, plan, rendered, len(appended), len(prompt))
    if isinstance(media, NotBridged):
        return media
    return Bridged(prompt, spans, appended_start, media, tuple(close))


def extended(
    prior: Prior, bridge: Sequence[int], reason: str, appended: Sequence[int]
) -> tuple[list[int], tuple[BridgeSpan, ...], int]:
    """The bridged prompt's ids: `prior`'s prompt and completion, the part of the turn close
    `bridge` (spanned with `reason` when not empty: `close_after`), then `appended`; its
    ``bridge_spans``, and where the appended tokens start."""
    prompt = [*prior.prompt_ids, *prior.completion_ids]
    start = len(prompt)
    spans: tuple[BridgeSpan, ...] = ((start, start + len(bridge), reason),) if bridge else ()
    prompt.extend(bridge)
    appended_start = len(prompt)
    prompt.extend(appended)
    return prompt, spans, appended_start


def _after_content(name: str, renders: Renders) -> list[int] | NotBridged:
    """What the template writes after the dummy content: a pair's common suffix, or what one
    render has after the prefix its pair showed (`AfterContent`)."""
    if isinstance(renders, AfterContent):
        return list(renders.ids)
    # Renders that do not differ hide where the dummy content is: the common suffix would be
    # the whole conversation.
    if list(renders[0]) == list(renders[1]):
        return NotBridged(
            "template_not_bridgeable",
            f"the two {name} renders are the same: the template does not render the "
            "assistant's content",
        )
    return common_suffix(*renders)


def _placed(
    prior: Prior, plan: BridgePlan, rendered: BridgeRenders, appended: int, end: int
) -> tuple[MediaItem, ...] | NotBridged:
    """The bridged prompt's multimodal items: the previous call's where they were, then the
    appended messages', which the suffix renders place counted from their end (`end` is the
    bridged prompt's length; `appended` how many tokens of it are the appended messages')."""
    items = rendered.media
    expected = media_parts(plan.extension.appended)
    if len(items) != expected:
        return NotBridged(
            "multimodal_append",
            f"the appended messages have {expected} images, their renders place {len(items)}",
        )
    for item in items:
        if item.offset < -appended or item.offset + item.length > 0:
            return NotBridged(
                "multimodal_append",
                "an image's placeholder is not in the appended messages' tokens",
            )
    placed = tuple(MediaItem(m.modality, m.hash, end + m.offset, m.length) for m in items)
    return (*(prior.media or ()), *placed)


def close_after(prior: Prior, close: Sequence[int]) -> tuple[list[int], str] | NotBridged:
    """The part of the turn close `close` the bridged prompt adds after `prior`'s completion,
    and its span reason (module docs)."""
    completion = prior.completion_ids
    on_token = prior.finish_reason in ("stop", "tool_calls") and not isinstance(
        prior.stop_reason, str
    )
    if on_token and completion:
        stop = completion[-1]
        at = next((i for i, t in enumerate(close) if t == stop), None)
        if at is None:
            return NotBridged(
                "stopped_on_other_token",
                f"the completion ended on token {stop}, which the turn close "
                f"{list(close)} does not hold: the template's close after it is unknown",
            )
        return list(close[at + 1 :]), TURN_CLOSE
    overlap = _overlap(completion, close)
    return list(close[overlap:]), TURN_CLOSE if overlap else END_OF_TURN_ADDED


def _overlap(completion: Sequence[int], close: Sequence[int]) -> int:
    """The largest k with completion[-k:] == close[:k] (0 when none)."""
    for k in range(min(len(completion), len(close)), 0, -1):
        if list(completion[len(completion) - k :]) == list(close[:k]):
            return k
    return 0


def divergence(
    bridged_prompt: Sequence[int], plain_prompt: Sequence[int], *, same: int = 0
) -> int | None:
    """The first position where the plain rendering differs from the bridged prompt (None: the
    same tokens). A prompt that is a strict prefix of the other differs at its length. `same`:
    how many ids at their start are already known to be equal (not compared again)."""
    a, b = bridged_prompt, plain_prompt
    if type(a) is not type(b) or not isinstance(a, list | array):
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    i = min(same, n)
    if i == 0 and a == b:
        return None
    # Whole blocks compared in C (two lists of 20k ids: no per-id Python loop), then the id.
    while i + _BLOCK <= n and a[i : i + _BLOCK] == b[i : i + _BLOCK]:
        i += _BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return None if i == n and len(a) == len(b) else i


_BLOCK = 512
