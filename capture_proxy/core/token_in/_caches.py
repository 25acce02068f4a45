"""What token-in keeps between calls: the templates' turn closes and anchors (`CloseRenders`),
and the staged prompts' JSON (`PromptJson`). The pipeline holds one of each for every rollout."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ._beside import GenerateTemplates

__all__ = ["CloseRenders", "IdsPair", "PromptJson"]

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
    ones did keeps to the whole ones (`needs_context`). Where the model's end of sequence sits
    in a close (`eos`) and how many of it a shape of appended messages holds (`stop_count`) let
    a steady call skip the dummy renders (`_steady`; `steady=False`: never). Everything is
    cleared for a new upstream process (its template may differ).
    """

    def __init__(
        self, limit: int = 256, anchor_bytes: int = 32 << 20, *, steady: bool = True
    ) -> None:
        self.limit = limit
        #: Whether a steady call reads its appended tokens from the request's own rendering
        #: when its shape allows (`_steady`); False: every bridged call makes dummy renders.
        self.steady = steady
        self.anchor_bytes = anchor_bytes
        self._pairs: OrderedDict[str, IdsPair] = OrderedDict()
        #: key -> anchor; None: pairs only.
        self._anchors: OrderedDict[str, bytes | None] = OrderedDict()
        self._anchored = 0
        #: By `shape_key`: the count of the close's stop token after a replayed answer's in the
        #: request's own rendering (`_steady`); None: that shape keeps to the dummy renders.
        self._counts: OrderedDict[str, int | None] = OrderedDict()
        #: By `BridgePlan.close_key`: where the model's end-of-sequence token sits in the close.
        self._eos: OrderedDict[str, int] = OrderedDict()
        #: The close keys whose templates need the dummies' context (`context_needed`).
        self._context: OrderedDict[str, None] = OrderedDict()
        #: By tokenizer fingerprint: the reasoning parser's start and end marker ids and the tool
        #: call start's (`count_reasoning_tokens`), None when the first two are not one token each.
        self.reasoning_markers: dict[str, tuple[int, int, int | None] | None] = {}
        #: Generate's requests without their prompts, by the request's other keys
        #: (``--token-in-beside``: `GenerateTemplates`).
        self.generate_templates = GenerateTemplates(limit)

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

    def stop_count(self, key: str) -> int | None:
        """The stop token count learnt for the shape `key` (None: not learnt, or dummies only)."""
        count = self._counts.get(key)
        if count is not None:
            self._counts.move_to_end(key)
        return count

    def counts_learnt(self, key: str) -> bool:
        """Whether the shape `key` was learnt (a count, or dummies only)."""
        return key in self._counts

    def learn_count(self, key: str, count: int | None) -> None:
        """Keep what a call with dummy renders showed of the shape `key` (`_steady`)."""
        self._counts[key] = count
        self._counts.move_to_end(key)
        while len(self._counts) > 4 * self.limit:
            self._counts.popitem(last=False)

    def eos(self, close_key: str) -> int | None:
        """Where the model's end-of-sequence token sits in `close_key`'s close (None: no
        completion has shown it yet)."""
        return self._eos.get(close_key)

    def learn_eos(self, close_key: str, at: int) -> None:
        """Keep where a completion that stopped on its end of sequence showed it in the close."""
        self._eos[close_key] = at
        self._eos.move_to_end(close_key)
        while len(self._eos) > self.limit:
            self._eos.popitem(last=False)

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
        self.generate_templates.clear()
        self._pairs.clear()
        self._anchors.clear()
        self._anchored = 0
        self._counts.clear()
        self._eos.clear()
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
