"""Which of a bridge plan's dummy renders one call sends (`Renders`), and the bridged prompt read
from their answers (`read_bridge`): pairs read from where their common suffix starts, single
renders against the anchor a pair showed (docs/token-in.md, "One render instead of a pair")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...adapters.vllm import (
    UpstreamProtocolError,
    pair_anchor,
    read_anchored,
    read_render,
    read_render_pair,
)
from ._assemble import assemble
from ._caches import CloseRenders, IdsPair
from ._media import MediaItem, media_parts, suffix_media
from ._values import AfterContent, Bridged, BridgePlan, BridgeRenders, Extension, NotBridged

__all__ = ["Renders", "read_bridge"]


class Renders:
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
        #: The keys whose single render did not start with its anchor (`read_bridge` adds them).
        self.unanchored: list[str] = []
        #: A render answered an error, or an answer that is not a render's (`read_bridge` sets it).
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


def read_bridge(
    extension: Extension,
    renders: Renders,
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
