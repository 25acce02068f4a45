"""The store head: one hash over every rollout's chain head, kept outside the store.

A rollout's chain head (`schemas.events.chain_head`) anchors that rollout; it says nothing of a
rollout deleted whole. The store head does: a writer publishes it with its commits (its log and
``/metrics``), an operator keeps the last one, and `Store.verify(expected_store_head=...)` (or
``inspect --verify --expected-store-head``) recomputes it from the store and names what differs.

It is a homomorphic set hash (LtHash, Bellare and Micciancio 1997; the 1024 lanes of 16 bits
that Lewi et al., "Securing Update Propagation with Homomorphic Hashing", 2019, recommend): each
rollout contributes a 2048-byte *leaf* derived from its id and chain head, and the *state* is
the lane-wise sum of the leaves modulo 2**16. A rollout whose head moves from ``a`` to ``b``
takes ``leaf(a)`` out and puts ``leaf(b)`` in, so the writer keeps it up to date in O(1) per
event, whatever the number of rollouts; the order in which rollouts were written does not
enter. The published ``head`` is the SHA-256 of the state. docs/digest.md ("The store head")
specifies every byte, with worked examples in tests/fixtures/digest/store-head-example.hex and
store-head-claims-example.hex.

A Parquet dataset holds each admission claim as a file before its ``claim`` event commits (the
event waits for the next unit), so the claim files enter the leaf too (`ClaimCount`: how many and
the highest seq): a claim file deleted after the head was published, the only trace of a call
a killed proxy had in flight, changes the head like a deleted event does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "LEAF_DOMAIN",
    "STATE_BYTES",
    "STORE_HEAD_DOMAIN",
    "ClaimCount",
    "StoreHead",
    "StoreHeadState",
    "store_head_leaf",
]

#: Domain prefix of a rollout's leaf (SHAKE-128 input).
LEAF_DOMAIN = b"capture-proxy:store-leaf:v1\x00"
#: Domain prefix of the head (SHA-256 input, followed by the state).
STORE_HEAD_DOMAIN = b"capture-proxy:store-head:v1\x00"
#: 1024 lanes of 16 bits, little-endian.
LANES = 1024
STATE_BYTES = 2 * LANES

# The state is one Python integer, its 16-bit lanes side by side (little-endian), added and
# subtracted lane by lane without carries crossing lanes (SIMD within a register): the lanes'
# low 15 bits are summed, and each lane's top bit is put back by XOR.
_TOP = int.from_bytes(b"\x00\x80" * LANES, "little")
_ALL = (1 << (8 * STATE_BYTES)) - 1
_LOW = _ALL ^ _TOP


def _add(a: int, b: int) -> int:
    return ((a & _LOW) + (b & _LOW)) ^ ((a ^ b) & _TOP)


def _sub(a: int, b: int) -> int:
    return ((a | _TOP) - (b & _LOW)) ^ ((a ^ b ^ _ALL) & _TOP)


#: Leaves kept for taking them out again: a writer takes out the leaf it put in at the
#: rollout's previous commit (about 2 KiB each, so at most ~2 MiB).
_LEAVES_KEPT = 1024


class ClaimCount(NamedTuple):
    """A rollout's claim files (a Parquet dataset's admission claims): how many, and the highest
    seq among them. None stands for a rollout without claim files (every SQLite rollout)."""

    files: int
    highest: int

    def plus(self, seqs: Iterable[int]) -> ClaimCount:
        """With claim files of `seqs` (new ones) added."""
        seqs = list(seqs)
        return ClaimCount(self.files + len(seqs), max([self.highest, *seqs]))

    @classmethod
    def of(cls, seqs: Iterable[int]) -> ClaimCount | None:
        seqs = list(seqs)
        return cls(len(seqs), max(seqs)) if seqs else None


def store_head_leaf(rollout_id: str, chain_head: str, claims: ClaimCount | None = None) -> bytes:
    """A rollout's 2048-byte leaf: SHAKE-128 over the leaf domain, then the rollout id and its
    chain head (64 hex characters; ``""`` for a rollout with claim files and no event) each as
    an ``S`` value of the canonical encoding, then, for a rollout with claim files, their count
    and the highest claimed seq each as an ``I`` value."""
    data = LEAF_DOMAIN + _s(rollout_id) + _s(chain_head)
    if claims is not None:
        data += _i(claims.files) + _i(claims.highest)
    return hashlib.shake_128(data).digest(STATE_BYTES)


def _s(text: str) -> bytes:
    """`text` as the canonical encoding's ``S`` value (`schemas.digest.encode_value`)."""
    data = text.encode()
    return b"S" + len(data).to_bytes(8, "little") + data


def _i(number: int) -> bytes:
    """`number` as the canonical encoding's ``I`` value (i64, little-endian)."""
    return b"I" + number.to_bytes(8, "little", signed=True)


@dataclass(frozen=True, slots=True)
class StoreHead:
    """A published store head: the hash, how many rollouts it covers (those with an event log or
    claim files), how many events their logs held (the sum of each head's position + 1) and how
    many claim files (a Parquet dataset's; 0 elsewhere, -1 when not kept)."""

    head: str
    rollouts: int
    events: int
    claims: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "store_head": self.head,
            "rollouts": self.rollouts,
            "events": self.events,
            "claims": self.claims,
        }

    def token(self) -> str:
        """``HEAD:ROLLOUTS:EVENTS``, and ``:CLAIMS`` when there are claim files: what the log
        line prints and `parse` reads back."""
        claims = f":{self.claims}" if self.claims > 0 else ""
        return f"{self.head}:{self.rollouts}:{self.events}{claims}"

    @classmethod
    def parse(cls, text: str) -> StoreHead:
        """``HEAD``, ``HEAD:ROLLOUTS``, ``HEAD:ROLLOUTS:EVENTS`` or ``HEAD:ROLLOUTS:EVENTS:CLAIMS``
        (what was kept; an absent count is -1, unknown). ValueError names what is wrong."""
        head, *counts = text.strip().split(":")
        if len(head) != 64 or any(c not in "0123456789abcdef" for c in head.lower()):
            raise ValueError(
                f"{text!r}: a store head is 64 hex characters (HEAD[:ROLLOUTS[:EVENTS[:CLAIMS]]])"
            )
        if len(counts) > 3 or not all(c.isdigit() for c in counts):
            raise ValueError(
                f"{text!r}: expected HEAD[:ROLLOUTS[:EVENTS[:CLAIMS]]], counts in digits"
            )
        rollouts, events, claims = [int(c) for c in counts] + [-1] * (3 - len(counts))
        return cls(head.lower(), rollouts, events, claims)


class StoreHeadState:
    """The running sum of leaves. Not thread-safe: one writer thread owns it."""

    __slots__ = ("_leaves", "_state", "claims", "events", "rollouts")

    def __init__(self) -> None:
        self._state = 0
        self.rollouts = 0
        self.events = 0
        self.claims = 0
        # (rollout, chain head, claims) -> the leaf as an integer, for the ones put in lately
        self._leaves: OrderedDict[tuple[str, str, ClaimCount | None], int] = OrderedDict()

    @classmethod
    def of(
        cls,
        heads: Iterable[tuple[str, str, int]],
        claims: Mapping[str, ClaimCount] | None = None,
    ) -> StoreHeadState:
        """The state over ``(rollout id, chain head, position of the head)``, one per rollout
        with events (`events` counts ``position + 1`` for each), and the claim files of each
        rollout that has some (`claims`; a rollout with claim files and no event enters with
        the chain head ``""``)."""
        claims = claims or {}
        state = cls()
        state.claims = sum(count.files for count in claims.values())
        seen = set()
        for rollout_id, head, position in heads:
            if not (isinstance(rollout_id, str) and isinstance(head, str)):
                raise TypeError(f"rollout {rollout_id!r}: its head {head!r} is not text")
            seen.add(rollout_id)
            state._add(store_head_leaf(rollout_id, head, claims.get(rollout_id)))
            state.rollouts += 1
            state.events += int(position) + 1
        for rollout_id, count in claims.items():
            if rollout_id not in seen:
                state._add(store_head_leaf(rollout_id, "", count))
                state.rollouts += 1
        return state

    def _add(self, leaf: bytes) -> None:
        self._state = _add(self._state, int.from_bytes(leaf, "little"))

    def _remove(self, leaf: bytes) -> None:
        self._state = _sub(self._state, int.from_bytes(leaf, "little"))

    def _leaf(self, rollout_id: str, head: str, claims: ClaimCount | None, keep: bool) -> int:
        key = (rollout_id, head, claims)
        leaf = self._leaves.pop(key, None)
        if leaf is None:
            leaf = int.from_bytes(store_head_leaf(rollout_id, head, claims), "little")
        if keep:  # put in now: kept to be taken out at the rollout's next move
            self._leaves[key] = leaf
            if len(self._leaves) > _LEAVES_KEPT:
                self._leaves.popitem(last=False)
        return leaf

    def move(
        self,
        rollout_id: str,
        before: tuple[str, ClaimCount | None],
        after: tuple[str, ClaimCount | None],
        events: int = 0,
    ) -> None:
        """`rollout_id`'s leaf moved from `before` to `after`, each ``(chain head, claims)``
        (``("", None)``: the rollout was not in the state), `events` more events committed."""
        self.events += events
        if before == after:
            return
        self.claims += (after[1].files if after[1] else 0) - (before[1].files if before[1] else 0)
        if before[0] or before[1] is not None:
            self._state = _sub(self._state, self._leaf(rollout_id, *before, keep=False))
        else:
            self.rollouts += 1
        self._state = _add(self._state, self._leaf(rollout_id, *after, keep=True))

    def advance(
        self, rollout_id: str, prev_hash: str, new_hash: str, claims: ClaimCount | None = None
    ) -> None:
        """A committed event moved `rollout_id`'s head from `prev_hash` (``""``: the rollout's
        first event) to `new_hash`; `claims`: the rollout's claim files meanwhile."""
        self.move(rollout_id, (prev_hash, claims), (new_hash, claims), 1)

    def state_bytes(self) -> bytes:
        """The 1024 lanes, little-endian: what the head hashes."""
        return self._state.to_bytes(STATE_BYTES, "little")

    def head(self) -> StoreHead:
        digest = hashlib.sha256(STORE_HEAD_DOMAIN + self.state_bytes()).hexdigest()
        return StoreHead(digest, self.rollouts, self.events, self.claims)
