"""The values the token-in bridge passes around: what it knows of the previous call, its
verdicts (`Extension`, `NotBridged`) and its results (`BridgePlan`, `BridgeRenders`, `Bridged`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...schemas.fields import BridgeSpan
from ._media import MediaItem, suffix_media

__all__ = [
    "BREAK_REASONS",
    "AfterContent",
    "BridgePlan",
    "BridgeRenders",
    "Bridged",
    "Extension",
    "NotBridged",
    "Prior",
]

#: Every reason a `NotBridged` can give, and when:
#:
#: - ``no_prior``: the rollout has no staged call to extend.
#: - ``history_edited``: the messages before the replayed answer are not the previous call's
#:   messages (edited, removed, truncated: OpenCode's compaction).
#: - ``tools_changed``: the tool list differs from the previous call's.
#: - ``template_changed``: a key the chat template reads (``chat_template_kwargs``, ...) differs.
#: - ``reply_mismatch``: the replayed assistant message is not what the model produced.
#: - ``nothing_appended``: the request ends with the replayed answer (no new message after it).
#: - ``assistant_appended``: an assistant message follows the replayed answer (the client wrote
#:   model turns of its own, or asks to continue one).
#: - ``multimodal_append``: an appended message has an image (a content part other than text)
#:   whose features the renders do not give consistently (docs/token-in.md, "Images").
#: - ``multimodal_history``: an earlier message has one whose placeholder positions the bridge
#:   does not have (more than the proxy keeps), or the leading system message has one.
#: - ``media_not_recorded``: the previous call was read back from the store (a restarted proxy)
#:   and its record keeps no placeholders for the images of the earlier messages (written before
#:   records kept them, more than the proxy keeps, or unreadable).
#: - ``template_not_bridgeable``: the renders do not have the structure the bridge needs (no
#:   common turn close, or the appended rendering does not start with it).
#: - ``stopped_on_other_token``: the previous completion stopped on a stop token the template's
#:   turn close does not hold (``<|endoftext|>`` where the close is ``<|im_end|>\n``).
#: - ``tokenizer_changed``: the upstream's tokenizer fingerprint (its tokenizer and chat
#:   template, `capture_proxy.upstream.facts`) is not the one the previous call was staged under:
#:   a vLLM restarted under the same served name with another model or template. The previous
#:   ids are another vocabulary's; they are never bridged onto.
BREAK_REASONS = (
    "no_prior",
    "history_edited",
    "tools_changed",
    "template_changed",
    "reply_mismatch",
    "nothing_appended",
    "assistant_appended",
    "multimodal_append",
    "multimodal_history",
    "media_not_recorded",
    "template_not_bridgeable",
    "stopped_on_other_token",
    "tokenizer_changed",
)


@dataclass(frozen=True, slots=True)
class Prior:
    """The rollout's last staged call, as the bridge needs it.

    Attributes:
        request: its normalized request as forwarded upstream (``messages``, ``tools``,
            ``model``, ``chat_template_kwargs`` and the other template keys; replayed reasoning
            under ``reasoning_content``); as staged when `stored` (images by reference).
        message: the assistant message of its answer (``content``, ``reasoning_content`` or
            ``reasoning``, ``tool_calls``), as the client received it.
        prompt_ids: the exact prompt token ids the model saw.
        completion_ids: the exact token ids the model sampled.
        finish_reason: the answer's finish reason (``stop``, ``length``, ...).
        media: the multimodal items of its prompt, in prompt order (``()``: none); None when
            they are not known (more than the proxy keeps, or a record that keeps none): then
            a request with images in its history is not bridged.
        stored: read back from the store (a restarted or resumed rollout): `request` is the
            record's, its images ``attachment:sha256:`` references, so its messages are
            compared with the new request as staged.
        fingerprint: the upstream's tokenizer fingerprint it was staged under ("" unknown):
            a call under another one is not bridged (``tokenizer_changed``).
        stop_reason: generate's ``stop_reason``: the stop string it stopped on (a str), a stop
            token id, or None (end of sequence, or not stopped).
    """

    request: Mapping[str, Any]
    message: Mapping[str, Any]
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    finish_reason: str | None
    media: tuple[MediaItem, ...] | None = None
    stored: bool = False
    fingerprint: str = ""
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class Extension:
    """The new request extends `prior`: its messages are the prior's, the replayed answer
    (`replayed`, as the client sent it), then `appended` (at least one message, none of them an
    assistant's)."""

    prior: Prior
    request: Mapping[str, Any]
    replayed: Mapping[str, Any]
    appended: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True, slots=True)
class NotBridged:
    """The call cannot be bridged: send the plain rendering and start a new segment.

    Attributes:
        reason: one of `BREAK_REASONS`.
        detail: a short sentence naming the first difference (message index, field).
    """

    reason: str
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in BREAK_REASONS:
            raise ValueError(f"unknown break reason {self.reason!r}")


@dataclass(frozen=True, slots=True)
class BridgePlan:
    """The render requests that reveal the template's tokens for one extension.

    Each request is a Chat Completions body for vLLM's render route, in pairs that differ only
    in the dummy assistant's content. `close` renders D(v) = [leading system, user "u",
    assistant v] without a generation prompt. `turn` (only when the replayed answer has tool
    calls, else None) renders the same with the replayed tool calls on the dummy assistant.
    `suffix` renders that dummy (with the tool calls, if any) + the appended messages with the
    request's generation prompt. `close_key` names what `close` depends on (model, system
    message, tools, template keys): two plans with the same key have the same close renders, so
    their answers can be cached under it. `requests()` lists every body to render.
    """

    extension: Extension
    close_key: str
    close: tuple[dict[str, Any], dict[str, Any]]
    suffix: tuple[dict[str, Any], dict[str, Any]]
    turn: tuple[dict[str, Any], dict[str, Any]] | None = None
    #: `turn` and `suffix` leave out the system message and the tools (`plan(lean=True)`).
    lean: bool = False

    def requests(self) -> list[dict[str, Any]]:
        """Every body to render: `close` (unless cached), `turn` if any, `suffix`."""
        return [*self.close, *(self.turn or ()), *self.suffix]


@dataclass(frozen=True, slots=True)
class AfterContent:
    """What one render has after the dummy assistant's content: the ids after the prefix a
    pair of the same kind showed to end with the content (``pair_anchor`` and
    ``read_anchored`` in ``capture_proxy.adapters.vllm``). It stands for that pair's common
    suffix: the flow reads a render so only when the prefix is byte for byte the pair's, and
    checks the appended messages' tokens against the request's own render (docs/token-in.md,
    "One render instead of a pair")."""

    ids: Sequence[int]


#: A pair of renders' ids, or one render's ids after the dummy content.
Renders = tuple[Sequence[int], Sequence[int]] | AfterContent


@dataclass(frozen=True, slots=True)
class BridgeRenders:
    """The token ids the render route answered for a plan's requests, in the plan's order.

    Of each pair, only the two lists' common suffix and whether they are the same are read: a
    pair may be given from the last id not in their common suffix on (``read_render_pair`` in
    ``capture_proxy.adapters.vllm``), rather than whole. `turn` is given exactly when the plan
    has a `turn` pair. `media` lists the multimodal items of the suffix renders (the appended
    messages' images), each `MediaItem.offset` counted from the end of the render (negative):
    the bridged prompt ends with the same tokens, so that is where they are in it too. `turn`
    and `suffix` may each be one render's ids after the content instead (`AfterContent`).
    """

    close: tuple[Sequence[int], Sequence[int]]
    suffix: Renders
    turn: Renders | None = None
    media: tuple[MediaItem, ...] = ()

    @classmethod
    def from_answers(
        cls,
        close: tuple[Mapping[str, Any], Mapping[str, Any]],
        suffix: tuple[Mapping[str, Any], Mapping[str, Any]],
        turn: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
    ) -> BridgeRenders:
        """Read render answers (vLLM's ``GenerateRequest``: ``token_ids``, ``features``).

        Raises ValueError naming the answer when its ``token_ids`` is not a list of ints, or
        when the two suffix answers' ``features`` are malformed or differ.
        """

        def pair(name: str, answers: tuple[Mapping[str, Any], Mapping[str, Any]]) -> Any:
            return tuple(_token_ids(f"{name}[{i}]", a) for i, a in enumerate(answers))

        suffix_ids = pair("suffix", suffix)
        media = suffix_media(
            (suffix[0].get("features"), suffix[1].get("features")), len(suffix_ids[0])
        )
        return cls(
            pair("close", close),
            suffix_ids,
            None if turn is None else pair("turn", turn),
            media,
        )


def _token_ids(name: str, answer: Mapping[str, Any]) -> list[int]:
    tokens = answer.get("token_ids")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ValueError(f"render answer {name}: token_ids must be a list of ints")
    return tokens


@dataclass(frozen=True, slots=True)
class Bridged:
    """The prompt of a bridged call.

    Attributes:
        prompt_ids: the previous call's prompt + completion ids, the bridge, then the template's
            tokens for the appended messages and the generation prompt.
        bridge_spans: ``(start, end, reason)`` over `prompt_ids`, half-open: the tokens the proxy
            inserted after the model's completion (``turn_close``: what the template puts after
            the end-of-turn token the model sampled; ``end_of_turn_added``: the whole turn close,
            for a completion that did not end on it). A trainer keeps them at loss mask 0.
        appended_start: where the appended messages' tokens start in `prompt_ids`.
        media: the prompt's multimodal items, in prompt order: the previous call's, then the
            appended messages', placed in `prompt_ids`.
    """

    prompt_ids: list[int]
    bridge_spans: tuple[BridgeSpan, ...] = field(default=())
    appended_start: int = 0
    media: tuple[MediaItem, ...] = ()
    #: The template's turn close, as its renders write it before the appended messages' tokens.
    #: `prompt_ids` has the model's own tokens there: the same ones, unless the model sampled
    #: its stop token without a token the close writes before it (Llama-2's space before
    #: ``</s>``).
    close: tuple[int, ...] = ()
