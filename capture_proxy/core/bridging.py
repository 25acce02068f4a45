"""The prompt a token-in call sends: the bridge's, or the plain rendering's (with the reason).

`token_in_prompt` does the upstream side of docs/token-in.md for one call. It asks the bridge
whether the request extends the rollout's previous staged call (`match`); if it does, it sends
the renders of the bridge's plan (the turn close from `CloseRenders` when cached; the other
dummies lean, without the system message and tools, unless the template needs them; one render
of a pair whose anchor it keeps) **at the same time as** the plain render of the request, then
assembles the exact prompt and measures where the plain one would have diverged. Otherwise, or
when the renders do not bridge, the plain render's ids are sent and the call starts a new
segment, with the reason. The plain render is always made: it is the ``GenerateRequest``
generate takes (sampling params resolved by vLLM, the effective sampling of the record), the
plain ids divergence is measured against, and the rendering that must end with the turn close
and the appended tokens the bridge found. With images, the bridged prompt's ``features`` are
the plain render's items placed where the bridge put them (`bridged_features`); the
placeholders are kept for the next call (`TokenInPrompt.media`).

The exchange (`capture_proxy.core.exchange`) sends the result to generate and derenders the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import orjson

from ..adapters.vllm import (
    Rendered,
    UpstreamProtocolError,
    encode_ids,
    extend_ids_json,
    pair_anchor,
    read_anchored,
    read_render,
    read_render_pair,
)
from ..errors import CaptureProxyError
from ..schemas.fields import BridgeSpan
from ..schemas.token_in_extras import SegmentBreak
from .token_in import (
    TEMPLATE_KEYS,
    AfterContent,
    Bridged,
    BridgePlan,
    BridgeRenders,
    Extension,
    MediaItem,
    NotBridged,
    Prior,
    assemble,
    bridged_features,
    divergence,
    match,
    media_items,
    media_parts,
    plan,
    suffix_media,
)
from .transport import EngineRoute, TokenInTransport

__all__ = [
    "CloseRenders",
    "PromptJson",
    "RenderRefused",
    "TokenInPrompt",
    "token_in_line",
    "token_in_prompt",
]

_T = TypeVar("_T")

#: At most this many bytes of a call's image placeholders (hashes and positions) are kept for
#: the next call's bridge; a call with more leaves the next one with images unbridged.
MEDIA_KEPT_BYTES = 64 * 1024

#: Request keys that set the output limit: unset, vLLM's render fills in the room the rendered
#: prompt leaves in the context window, which a longer bridged prompt does not have.
_LIMIT_KEYS = ("max_tokens", "max_completion_tokens")


def token_in_line(request: Mapping[str, Any]) -> str:
    """Which line of calls a request belongs to: a hash of its tools, template keys and leading
    system message. The calls of one agent loop share them; a side call in the same rollout
    (OpenCode's title call: no tools, its own system prompt) has its own line, so it never
    comes between a call and the next one of the loop."""
    messages = request.get("messages") or []
    lead = messages[0] if messages and messages[0].get("role") == "system" else None
    keys = {k: request[k] for k in TEMPLATE_KEYS if request.get(k) is not None}
    line = {"tools": request.get("tools") or [], "keys": keys, "system": lead}
    return hashlib.sha256(orjson.dumps(line, option=orjson.OPT_SORT_KEYS)).hexdigest()


#: The token ids of a pair of renders.
IdsPair = tuple[Sequence[int], Sequence[int]]


class CloseRenders:
    """What the bridge learns of a template once and keeps for every rollout: the close renders'
    token ids by `BridgePlan.close_key` (most recent `limit` kept), and the anchors of the
    dummy conversations (`anchor`, most recent `anchor_bytes` of them kept).

    The close depends only on the model, the system message, the tools and the template keys,
    so one pair serves every later call of every rollout with the same ones. A pair is kept as
    `read_render_pair` gives it: the ids from where the two lists' common suffix starts; they
    were checked when their answers were read and are used as they are.

    An anchor is the JSON of a dummy conversation's ids up to and including its one-token
    content, as a pair showed it (`pair_anchor`); with it, the next calls of the same kind
    render the dummy once instead of twice (docs/token-in.md, "One render instead of a
    pair"). A kind whose single render once did not start with its anchor goes back to pairs
    for good (`pairs_only`); a template whose lean dummies once did not bridge where the whole
    ones did keeps to the whole ones (`needs_context`). Everything is cleared for a new
    upstream process (its template may differ).
    """

    def __init__(self, limit: int = 256, anchor_bytes: int = 32 << 20) -> None:
        self.limit = limit
        self.anchor_bytes = anchor_bytes
        self._pairs: OrderedDict[str, IdsPair] = OrderedDict()
        #: key -> anchor; None: pairs only.
        self._anchors: OrderedDict[str, bytes | None] = OrderedDict()
        self._anchored = 0
        #: The close keys whose templates need the dummies' context (`context_needed`).
        self._context: OrderedDict[str, None] = OrderedDict()
        #: By tokenizer fingerprint: the reasoning parser's start and end marker ids, None when
        #: they are not one token each (what the chat route's ``reasoning_tokens`` counts between).
        self.reasoning_markers: dict[str, tuple[int, int] | None] = {}

    def get(self, key: str) -> IdsPair | None:
        pair = self._pairs.get(key)
        if pair is not None:
            self._pairs.move_to_end(key)
        return pair

    def put(self, key: str, pair: IdsPair) -> None:
        self._pairs[key] = pair
        self._pairs.move_to_end(key)
        while len(self._pairs) > self.limit:
            self._pairs.popitem(last=False)

    def anchor(self, key: str) -> bytes | None:
        """The anchor learnt for `key` (None: none yet, or pairs only)."""
        anchor = self._anchors.get(key)
        if anchor is not None:
            self._anchors.move_to_end(key)
        return anchor

    def learns(self, key: str) -> bool:
        """Whether an anchor for `key` is still to be learnt (none yet, and not pairs only)."""
        return key not in self._anchors

    def learn(self, key: str, anchor: bytes) -> None:
        """Keep `anchor` for `key`, unless the key is pairs only."""
        if key in self._anchors or len(anchor) > self.anchor_bytes:
            return
        self._anchors[key] = anchor
        self._anchored += len(anchor)
        while self._anchored > self.anchor_bytes:
            old = next(k for k, v in self._anchors.items() if v is not None)
            self._anchored -= len(self._anchors.pop(old) or b"")

    def pairs_only(self, key: str) -> None:
        """Render `key`'s dummies as pairs from now on."""
        self._anchored -= len(self._anchors.get(key) or b"")
        self._anchors[key] = None
        self._anchors.move_to_end(key)
        while len(self._anchors) > 4 * self.limit:  # the keys marked pairs only, bounded
            self._anchored -= len(self._anchors.popitem(last=False)[1] or b"")

    def needs_context(self, key: str) -> bool:
        """Whether `key`'s template needs the dummies with the system message and the tools
        (its lean dummies once did not bridge where those did)."""
        return key in self._context

    def context_needed(self, key: str) -> None:
        """Render `key`'s dummies with the system message and the tools from now on."""
        self._context[key] = None
        self._context.move_to_end(key)
        while len(self._context) > self.limit:
            self._context.popitem(last=False)

    def clear(self) -> None:
        self.reasoning_markers.clear()
        self._pairs.clear()
        self._anchors.clear()
        self._anchored = 0
        self._context.clear()

    def __len__(self) -> int:
        return len(self._pairs)


class PromptJson:
    """The JSON of staged calls' prompt ids, kept for the calls that extend them.

    A bridged prompt starts with the previous call's prompt ids (`Prior.prompt_ids`), so its
    JSON is that prompt's JSON extended by the new ids (`extend_ids_json`) instead of a whole
    new encoding. Keyed by the prior's ids object itself (`put` when the call is staged, `get`
    with the same object; `discard` once a later call of its line is staged), the least recently
    used dropped first beyond `max_bytes` of JSON and ids.
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[int, tuple[Sequence[int], bytes, int]] = OrderedDict()

    def put(self, ids: Sequence[int], ids_json: bytes) -> None:
        size = len(ids_json) + 4 * len(ids)
        self._drop(id(ids))
        if size > self.max_bytes:
            return
        # The ids object is kept with its JSON: its id() names no other object while it is here.
        self._entries[id(ids)] = (ids, ids_json, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, ids: Sequence[int]) -> bytes | None:
        entry = self._entries.get(id(ids))
        if entry is None or entry[0] is not ids:
            return None
        self._entries.move_to_end(id(ids))
        return entry[1]

    def discard(self, ids: Sequence[int]) -> None:
        """Forget the JSON of `ids` (a prior its line's next staged call replaced)."""
        entry = self._entries.get(id(ids))
        if entry is not None and entry[0] is ids:
            self._drop(id(ids))

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[2]

    def __len__(self) -> int:
        return len(self._entries)


class RenderRefused(CaptureProxyError):
    """The upstream answered the request's own render with an error status: the call's answer,
    relayed to the client as the chat route's error would be."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"render answered {status}")
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class TokenInPrompt:
    """What a token-in call sends to generate, and what its record says of it.

    Attributes:
        rendered: the plain render of the request (vLLM's ``GenerateRequest``).
        prompt_ids: the ids to generate from: the bridged prompt, or the plain one.
        bridge_spans: the prompt tokens the proxy inserted (``()`` for a plain prompt).
        segment_break: why the call starts a new segment (None: it extends the previous call).
        plain_divergence: where the plain ids differ from the bridged ones (None: they do not,
            or the plain ids were sent).
        features: the ``features`` generate gets instead of the render's, for a bridged prompt
            with images (None: the render's, as they came).
        bridged_media: a bridged prompt's images (`media` reads the plain render's otherwise).
        ids_json: `prompt_ids` as a JSON list, encoded once for generate and derender
            (`prompt_json`; when not given: the plain render's JSON as it came for its own ids,
            else encoded).
    """

    rendered: Rendered
    prompt_ids: list[int]
    bridge_spans: tuple[BridgeSpan, ...] = ()
    segment_break: SegmentBreak | None = None
    plain_divergence: int | None = None
    features: dict[str, Any] | None = None
    bridged_media: tuple[MediaItem, ...] | None = None
    ids_json: bytes | None = None
    #: `prompt_ids` as int32 (the record's), when built from the prior's without a conversion.
    ids_array: array[int] | None = None

    def __post_init__(self) -> None:
        if self.ids_json is None:
            rendered = self.rendered
            plain = self.prompt_ids is rendered.prompt_ids
            ids_json = rendered.prompt_json if plain else encode_ids(self.prompt_ids)
            object.__setattr__(self, "ids_json", ids_json)

    @property
    def prompt_array(self) -> array[int]:
        """`prompt_ids` as an int32 array, as the record keeps them."""
        return self.ids_array if self.ids_array is not None else array("i", self.prompt_ids)

    @property
    def prompt_json(self) -> bytes:
        """`prompt_ids` as a JSON list (generate and derender send it as it is)."""
        assert self.ids_json is not None  # set by __post_init__
        return self.ids_json

    @property
    def media(self) -> tuple[MediaItem, ...] | None:
        """The prompt's images as the next call's bridge needs them (`Prior.media`); None when
        the render's ``features`` cannot be read, or they are more than `MEDIA_KEPT_BYTES`."""
        media = self.bridged_media
        if media is None:
            try:
                media = media_items(self.rendered.features)
            except ValueError:
                return None
        if sum(len(m.hash) + len(m.modality) + 16 for m in media) > MEDIA_KEPT_BYTES:
            return None
        return media

    def generate_body(self, request: Mapping[str, Any], *, stream: bool) -> bytes:
        """The generate request: the plain render's answer with `prompt_ids`. When `request`
        sets no output limit, vLLM's render chose the room its own prompt left in the context
        window; a longer bridged prompt has that much less."""
        rendered = self.rendered
        if self.features is not None:
            features = msgspec.Raw(orjson.dumps(self.features))
            rendered = dataclasses.replace(rendered, rest={**rendered.rest, "features": features})
        grown = len(self.prompt_ids) - len(rendered.prompt_ids)
        params = rendered.resolved_sampling
        limit = params.get("max_tokens")
        unset = all(request.get(k) is None for k in _LIMIT_KEYS)
        if grown > 0 and unset and type(limit) is int:
            params = {**params, "max_tokens": max(1, limit - grown)}
            return rendered.generate_body(
                self.prompt_ids, stream=stream, sampling_params=params, ids_json=self.prompt_json
            )
        return rendered.generate_body(self.prompt_ids, stream=stream, ids_json=self.prompt_json)


async def _render(upstream: TokenInTransport, body: bytes) -> tuple[int, bytes]:
    async with await upstream.post_engine(EngineRoute.RENDER, body) as reply:
        return reply.status, await reply.read()


async def _all(*aws: Awaitable[_T]) -> list[_T]:
    """Every result, the requests under way at once; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def token_in_prompt(
    upstream: TokenInTransport,
    closes: CloseRenders,
    prior: Prior | None,
    request: Mapping[str, Any],
    render_request: Mapping[str, Any] | bytes,
    prompts: PromptJson | None = None,
    staged: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
) -> TokenInPrompt:
    """The prompt of a token-in call (module docs). `request` is the normalized request as
    the bridge compares it with `prior.request`; `render_request` the body to render (the
    request as forwarded, with the token fields capture asks for), encoded or not. A bridged
    prompt's JSON extends the prior's from `prompts` when it has it. `staged` is the request
    as staged (images by reference), which a prior read back from the store is compared with.

    Raises `RenderRefused` when the upstream refuses to render the request, `UpstreamFailed`
    when it cannot be reached.
    """
    verdict = match(prior, request, staged, fingerprint)
    if isinstance(render_request, bytes):
        plain_body = render_request
    else:
        plain_body = orjson.dumps(render_request)
    if isinstance(verdict, NotBridged):
        status, raw = await _render(upstream, plain_body)
        return TokenInPrompt(*_plain(status, raw), segment_break=_break(verdict))
    lean = plan(request, verdict, lean=True)
    bridge = plan(request, verdict) if closes.needs_context(lean.close_key) else lean
    # The prior's prompt JSON, when kept: the renders' ids mostly start as it does.
    kept = prompts.get(verdict.prior.prompt_ids) if prompts is not None else None
    plain_render = asyncio.ensure_future(_render(upstream, plain_body))
    try:
        got, failed = await _bridge(upstream, closes, verdict, bridge, kept)
        status, raw = await plain_render
    except BaseException:
        plain_render.cancel()
        raise
    if status != 200:
        raise RenderRefused(status, raw)
    checked = _checked(got, raw, verdict.prior, kept)
    if isinstance(checked, NotBridged) and bridge.lean and not failed:
        # The lean dummies did not bridge, or not as the request renders: this template may
        # render the turn or the appended messages differently without the system message or
        # the tools. The dummies with them decide, as without lean dummies. (A render that
        # failed is the call's break, as it would be with them.)
        bridge = plan(request, verdict)
        whole, _ = await _bridge(upstream, closes, verdict, bridge, kept)
        checked = _checked(whole, raw, verdict.prior, kept)
        if not isinstance(checked, NotBridged):
            closes.context_needed(bridge.close_key)
    if isinstance(checked, NotBridged):
        rendered, plain_ids = _plain(status, raw)
        return TokenInPrompt(rendered, plain_ids, segment_break=_break(checked))
    got, rendered, ids_json = checked
    features, why = bridged_features(got.media, rendered.features)
    if why is not None:
        cut = SegmentBreak("multimodal_append", f"the images' features: {why}")
        return TokenInPrompt(rendered, rendered.prompt_ids, segment_break=cut)
    return TokenInPrompt(
        rendered,
        got.prompt_ids,
        tuple(got.bridge_spans),
        None,
        divergence(got.prompt_ids, rendered.prompt_ids, same=rendered.known_prefix),
        features,
        got.media,
        ids_json,
        _bridged_array(got, verdict.prior),
    )


async def _bridge(
    upstream: TokenInTransport,
    closes: CloseRenders,
    extension: Extension,
    bridge: BridgePlan,
    kept: bytes | None,
) -> tuple[Bridged | NotBridged, bool]:
    """The bridged prompt from `bridge`'s renders (`_Renders`: one render of a pair whose
    anchor is known), and whether a render failed (an error status, or not a render's answer).
    Single renders that do not bridge are rendered as whole pairs, which decide; a kind whose
    render did not start with its anchor keeps to pairs from then on."""
    renders = _Renders(bridge, closes, extension)
    answers = await _all(*(_render(upstream, orjson.dumps(b)) for b in renders.bodies))
    got = _bridged(extension, renders, answers, closes, kept)
    if renders.anchored and isinstance(got, NotBridged):
        for key in renders.unanchored:
            closes.pairs_only(key)
        seconds = await _all(*(_render(upstream, orjson.dumps(b)) for b in renders.seconds))
        got = _bridged(extension, renders, renders.paired(answers, seconds), closes, kept)
    return got, renders.failed


def _checked(
    got: Bridged | NotBridged, raw: bytes, prior: Prior, kept: bytes | None
) -> tuple[Bridged, Rendered, bytes] | NotBridged:
    """The bridged prompt with the request's own render (`raw`, read against the bridged ids)
    and the prompt's JSON, when the render ends as the bridge says (`_appended_as_rendered`)."""
    if isinstance(got, NotBridged):
        return got
    ids_json = _bridged_json(got, prior, kept)
    # The plain rendering mostly spells the bridged prompt's ids: only the rest is decoded.
    rendered = read_render(raw, known=(ids_json, got.prompt_ids))
    if not _appended_as_rendered(got, rendered):
        return NotBridged("template_not_bridgeable", _NOT_AS_RENDERED)
    return got, rendered, ids_json


#: Why a call is not bridged when the request's own rendering disagrees with the bridge.
_NOT_AS_RENDERED = (
    "the request's own rendering does not end with the turn close and the appended messages' "
    "tokens the dummy renders give: the template writes them differently after this "
    "conversation"
)


def _appended_as_rendered(got: Bridged, rendered: Rendered) -> bool:
    """Whether the request's own rendering ends with the turn close and the appended messages'
    tokens (and the generation prompt) the bridge found: the template writes them after the real
    conversation as after the dummy one, and the appended ones start where the bridge says (the
    close before them). Anything else would send the model tokens its template does not write
    there."""
    end = got.prompt_ids[max(got.appended_start - got.close_length, 0) :]
    plain = rendered.prompt_ids
    return len(plain) >= len(end) and plain[len(plain) - len(end) :] == end


class _Renders:
    """Which of a plan's renders one call sends: the close pair unless cached, the turn and
    suffix pairs, or only the first of a pair whose anchor is known (`CloseRenders.anchor`)."""

    def __init__(self, bridge: BridgePlan, closes: CloseRenders, extension: Extension) -> None:
        self.bridge = bridge
        self.cached = closes.get(bridge.close_key)
        calls = bridge.turn is not None
        dummies = "lean" if bridge.lean else "whole"
        self.turn_key = f"{bridge.close_key}/{dummies}/turn"
        self.suffix_key = f"{bridge.close_key}/{dummies}/suffix/{int(calls)}"
        self.turn_anchor = self.suffix_anchor = None
        if self.cached is not None:
            if calls:
                self.turn_anchor = closes.anchor(self.turn_key)
            # Appended images are placed by the pair's two renders (`suffix_media`).
            if not media_parts(extension.appended):
                self.suffix_anchor = closes.anchor(self.suffix_key)
        #: The keys whose single render did not start with its anchor (`_bridged` adds them).
        self.unanchored: list[str] = []
        #: A render answered an error, or an answer that is not a render's (`_bridged` sets it).
        self.failed = False
        #: The keys whose single render this call reads against an anchor.
        self.anchored = [
            k
            for k, a in ((self.turn_key, self.turn_anchor), (self.suffix_key, self.suffix_anchor))
            if a is not None
        ]
        turn = bridge.turn or ()
        self.bodies = [
            *(bridge.close if self.cached is None else ()),
            *(turn[:1] if self.turn_anchor is not None else turn),
            *(bridge.suffix[:1] if self.suffix_anchor is not None else bridge.suffix),
        ]
        #: The second renders of the anchored pairs, for a call bridged from pairs after all.
        self.seconds = [
            *(turn[1:] if self.turn_anchor is not None else ()),
            *(bridge.suffix[1:] if self.suffix_anchor is not None else ()),
        ]

    def paired(
        self, answers: Sequence[tuple[int, bytes]], seconds: Sequence[tuple[int, bytes]]
    ) -> list[tuple[int, bytes]]:
        """`answers` (of `bodies`) with `seconds` put after their firsts: every pair whole. The
        anchors are dropped: the answers are read as pairs."""
        out = list(answers)
        more = list(seconds)
        at = len(self.bridge.close) if self.cached is None else 0
        if self.turn_anchor is not None:
            out.insert(at + 1, more.pop(0))
        if self.bridge.turn is not None:
            at += 2
        if self.suffix_anchor is not None:
            out.insert(at + 1, more.pop(0))
        self.turn_anchor = self.suffix_anchor = None
        self.anchored = []
        return out


def _bridged_array(got: Bridged, prior: Prior) -> array[int] | None:
    """The bridged prompt as int32: the prior's ids when they are already an array (a staged
    call's), copied, then the ids after them; None when they are not (converted when needed)."""
    head = prior.prompt_ids
    if not (isinstance(head, array) and head.typecode == "i"):
        return None
    return head + array("i", got.prompt_ids[len(head) :])


def _bridged_json(got: Bridged, prior: Prior, kept: bytes | None) -> bytes:
    """The bridged prompt's JSON: it starts with the prior's prompt ids (`assemble`), so the
    prior's JSON when kept (`PromptJson`), extended by the ids after them."""
    if kept is None:
        return encode_ids(got.prompt_ids)
    return extend_ids_json(kept, got.prompt_ids[len(prior.prompt_ids) :])


def _plain(status: int, raw: bytes) -> tuple[Rendered, list[int]]:
    if status != 200:
        raise RenderRefused(status, raw)
    rendered = read_render(raw)
    return rendered, rendered.prompt_ids


def _break(verdict: NotBridged) -> SegmentBreak:
    return SegmentBreak(verdict.reason, verdict.detail)


def _bridged(
    extension: Extension,
    renders: _Renders,
    answers: Sequence[tuple[int, bytes]],
    closes: CloseRenders,
    kept: bytes | None = None,
) -> Bridged | NotBridged:
    """The bridged prompt from the answers to `renders.bodies`. Each pair is read once, and
    only from where its two lists' common suffix starts (`read_render_pair`): that suffix, and
    whether the two are the same, is all `assemble` reads of a pair; a pair that shows where
    its dummy content ends teaches `closes` its anchor. A single render is read against its
    anchor (`read_anchored`); one that does not start with it is `NotBridged` (the flow then
    renders its pair). `kept`: the prior's prompt JSON, which the answers' ids mostly start
    with (not parsed again)."""
    for status, raw in answers:
        if status != 200:
            renders.failed = True
            text = raw[:200].decode(errors="replace")
            return NotBridged(
                "template_not_bridgeable", f"a render of the bridge answered {status}: {text}"
            )
    bridge = renders.bridge
    read: list[IdsPair | AfterContent] = []
    features: list[Any] = []
    todo = list(answers)
    kinds = [
        *((("close", None, None),) if renders.cached is None else ()),
        *((("turn", renders.turn_key, renders.turn_anchor),) if bridge.turn is not None else ()),
        ("suffix", renders.suffix_key, renders.suffix_anchor),
    ]
    try:
        for _, key, anchor in kinds:
            if anchor is not None:
                single = read_anchored(todo.pop(0)[1], anchor)
                if single is None:
                    assert key is not None
                    renders.unanchored.append(key)
                    return NotBridged(
                        "template_not_bridgeable",
                        "a dummy render does not start as its pair did",
                    )
                read.append(AfterContent(single[0]))
                features.extend((single[1], single[1]))
                continue
            (_, first), (_, second) = todo.pop(0), todo.pop(0)
            ids, pair_features = read_render_pair(first, second, kept)
            read.append(ids)
            features.extend(pair_features)
            if key is not None and closes.learns(key):
                learnt = pair_anchor(first, second)
                if learnt is not None:
                    closes.learn(key, learnt)
        suffix_features = (features[-2], features[-1])
        if any(f is not None for f in features[:-2]):
            return NotBridged("multimodal_history", "a render of the earlier turn has images")
        media: tuple[MediaItem, ...] = ()
        if any(f is not None for f in suffix_features):
            if isinstance(read[-1], AfterContent):
                return NotBridged("multimodal_append", "a dummy render has images")
            # Rare (images appended): the whole answer read again, for its length.
            length = len(read_render(answers[-2][1]).prompt_ids)
            media = suffix_media(suffix_features, length)
    except UpstreamProtocolError as e:
        renders.failed = True
        return NotBridged("template_not_bridgeable", f"a render of the bridge: {e.message}")
    except ValueError as e:
        return NotBridged("multimodal_append", f"the renders' image features: {e}")
    close = renders.cached
    if close is None:
        first_pair = read.pop(0)
        assert not isinstance(first_pair, AfterContent)
        close = first_pair
        closes.put(bridge.close_key, close)
    turn = read.pop(0) if bridge.turn is not None else None
    rendered = BridgeRenders(close, read[0], turn, media)
    return assemble(extension.prior, bridge, rendered)
