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
