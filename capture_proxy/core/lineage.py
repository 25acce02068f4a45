"""Which earlier call a new call continues: the parent search over all of a rollout's calls.

A call's parent is, by definition, the earlier call of its rollout whose prompt + completion
shares the longest common prefix with the new call's prompt (ties: the latest; earlier attempts
of the same request, its retries, excluded). `LineageIndex` answers that exactly for every call
the rollout staged, without comparing the prompt with each of them.

It is a trie of token blocks: every staged sequence (prompt + completion) is cut into blocks of
`BLOCK` tokens, and the path of its full blocks from the root is shared with every other sequence
that starts the same way; what is left after its last full block (fewer than `BLOCK` tokens) is
kept as a tail on the node where it ends. Each node remembers the latest calls that pass through
it. A prompt walks down the trie block by block (one dict lookup per block: the dict compares the
block's bytes exactly, so no hash collision can mislead it) to the deepest node every token of
which it shares; the parent then sits at that node or on the way back up, among the few
sequences that leave the path inside one block.

Cost per call: O(prompt length) to walk it, plus O(BLOCK) per sequence that branches off inside
the block where the prompt diverges; adding a staged call is O(its length).

Memory per rollout: one node per distinct block of the rollout's sequences — a session whose calls
extend each other stores each token once (4 bytes, plus about 0.3 KB of bookkeeping per
256-token block) — and up to one tail (< `BLOCK` tokens) per call. It grows with the rollout's
distinct tokens, as its storage does; `--max-rollout-bytes` bounds both.
"""

from __future__ import annotations

from array import array

from ..schemas.tokens import common_prefix_len

__all__ = ["BLOCK", "LineageIndex"]

#: Tokens per trie block. Smaller blocks cost more nodes (bookkeeping per node is about the size
#: of 80 tokens); larger ones more tokens compared where sequences branch.
BLOCK = 256

#: A call through a node: (seq, call_id, request_key). Ordered by seq: "latest" is the highest.
_Entry = tuple[int, str, bytes]


def _note(entries: list[_Entry], entry: _Entry) -> None:
    """Keep, of the calls through a node, the latest of each of the two latest request keys.

    Two suffice: a search excludes one request key (the new call's retries), so the latest call
    with any other key is always among them.
    """
    seq, _, key = entry
    if not entries or seq > entries[0][0]:
        # The common case, a call later than every one kept (calls are indexed in staging
        # order): it comes first, then the latest kept call with another key.
        entries[:] = [entry, *[e for e in entries if e[2] != key][:1]]
        return
    for e in entries:
        if e[2] == key and e[0] >= seq:
            return  # a later attempt of the same request is already kept
    kept = [e for e in entries if e[2] != key]
    kept.append(entry)
    kept.sort(reverse=True)
    entries[:] = kept[:2]


def _latest(entries: list[_Entry], exclude: bytes) -> _Entry | None:
    for e in entries:
        if e[2] != exclude:
            return e
    return None


class _Node:
    __slots__ = ("children", "latest", "tails")

    def __init__(self) -> None:
        #: The next block's int32 bytes -> the node after it.
        self.children: dict[bytes, _Node] = {}
        #: Calls whose sequence ends inside the next block: its tokens' bytes -> those calls
        #: (b"" for a sequence that ends exactly here).
        self.tails: dict[bytes, list[_Entry]] = {}
        #: The latest calls whose sequence passes through this node (see `_note`).
        self.latest: list[_Entry] = []


def _tokens(raw: bytes) -> array[int]:
    out = array("i")
    out.frombytes(raw)
    return out


class LineageIndex:
    """Every staged call of one rollout, searchable by longest common prefix (module docs)."""

    __slots__ = ("_root", "calls")

    def __init__(self) -> None:
        self._root = _Node()
        #: Staged calls indexed.
        self.calls = 0

    def add(self, seq: int, call_id: str, full: array[int], request_key: bytes) -> None:
        """Index a staged call's prompt + completion (`full`)."""
        entry = (seq, call_id, request_key)
        node = self._root
        _note(node.latest, entry)
        raw = full.tobytes()
        size = 4 * BLOCK
        whole = len(raw) - len(raw) % size
        for start in range(0, whole, size):
            block = raw[start : start + size]
            child = node.children.get(block)
            if child is None:
                child = node.children[block] = _Node()
            node = child
            _note(node.latest, entry)
        _note(node.tails.setdefault(raw[whole:], []), entry)
        self.calls += 1

    def choose(self, prompt: array[int], request_key: bytes) -> str | None:
        """The parent of a call with this `prompt` and request key (None: nothing shared).

        The staged call whose prompt + completion shares the longest prefix with `prompt`; ties
        go to the latest (highest seq); calls with the same `request_key` (earlier attempts of
        the same request) are not candidates.
        """
        raw = prompt.tobytes()
        size = 4 * BLOCK
        path = [self._root]
        node = self._root
        start = 0
        while start + size <= len(raw):
            child = node.children.get(raw[start : start + size])
            if child is None:
                break
            path.append(child)
            node = child
            start += size
        # Sequences that leave the path inside block `depth` share depth * BLOCK tokens and
        # fewer than BLOCK more: every one found at a depth beats every one found above it.
        for depth in range(len(path) - 1, -1, -1):
            node = path[depth]
            on_path = path[depth + 1] if depth + 1 < len(path) else None
            rest = prompt[depth * BLOCK : (depth + 1) * BLOCK]
            best: tuple[int, int, str] | None = None  # (shared, seq, call_id)
            for block, child in node.children.items():
                if child is on_path:
                    continue
                entry = _latest(child.latest, request_key)
                if entry is not None:
                    shared = common_prefix_len(_tokens(block), rest)
                    best = max(best or (-1, -1, ""), (shared, entry[0], entry[1]))
            for tail, entries in node.tails.items():
                entry = _latest(entries, request_key)
                if entry is not None:
                    shared = common_prefix_len(_tokens(tail), rest)
                    best = max(best or (-1, -1, ""), (shared, entry[0], entry[1]))
            if best is not None:
                shared = depth * BLOCK + best[0]
                return best[2] if shared > 0 else None
        return None
