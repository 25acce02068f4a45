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
specifies every byte, with a worked example in tests/fixtures/digest/store-head-example.hex.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "LEAF_DOMAIN",
    "STATE_BYTES",
    "STORE_HEAD_DOMAIN",
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


def store_head_leaf(rollout_id: str, chain_head: str) -> bytes:
    """A rollout's 2048-byte leaf: SHAKE-128 over the leaf domain, then the rollout id and its
    chain head (64 hex characters) each as an ``S`` value of the canonical encoding."""
    return hashlib.shake_128(LEAF_DOMAIN + _s(rollout_id) + _s(chain_head)).digest(STATE_BYTES)


def _s(text: str) -> bytes:
    """`text` as the canonical encoding's ``S`` value (`schemas.digest.encode_value`)."""
    data = text.encode()
    return b"S" + len(data).to_bytes(8, "little") + data


@dataclass(frozen=True, slots=True)
class StoreHead:
    """A published store head: the hash, how many rollouts it covers (those with an event log)
    and how many events their logs held (the sum of each head's position + 1)."""

    head: str
    rollouts: int
    events: int

    def as_dict(self) -> dict[str, object]:
        return {"store_head": self.head, "rollouts": self.rollouts, "events": self.events}

    def token(self) -> str:
        """``HEAD:ROLLOUTS:EVENTS``, what the log line prints and `parse` reads back."""
        return f"{self.head}:{self.rollouts}:{self.events}"

    @classmethod
    def parse(cls, text: str) -> StoreHead:
        """``HEAD``, ``HEAD:ROLLOUTS`` or ``HEAD:ROLLOUTS:EVENTS`` (what was kept; an absent
        count is -1, unknown). ValueError names what is wrong."""
        head, *counts = text.strip().split(":")
        if len(head) != 64 or any(c not in "0123456789abcdef" for c in head.lower()):
            raise ValueError(
                f"{text!r}: a store head is 64 hex characters (HEAD[:ROLLOUTS[:EVENTS]])"
            )
        if len(counts) > 2 or not all(c.isdigit() for c in counts):
            raise ValueError(f"{text!r}: expected HEAD[:ROLLOUTS[:EVENTS]], counts in digits")
        rollouts, events = [int(c) for c in counts] + [-1] * (2 - len(counts))
        return cls(head.lower(), rollouts, events)


class StoreHeadState:
    """The running sum of leaves. Not thread-safe: one writer thread owns it."""

    __slots__ = ("_state", "events", "rollouts")

    def __init__(self) -> None:
        self._state = 0
        self.rollouts = 0
        self.events = 0

    @classmethod
    def of(cls, heads: Iterable[tuple[str, str, int]]) -> StoreHeadState:
        """The state over ``(rollout id, chain head, position of the head)``, one per rollout
        (`events` counts ``position + 1`` for each)."""
        state = cls()
        for rollout_id, head, position in heads:
            if not (isinstance(rollout_id, str) and isinstance(head, str)):
                raise TypeError(f"rollout {rollout_id!r}: its head {head!r} is not text")
            state._add(store_head_leaf(rollout_id, head))
            state.rollouts += 1
            state.events += int(position) + 1
        return state

    def _add(self, leaf: bytes) -> None:
        self._state = _add(self._state, int.from_bytes(leaf, "little"))

    def _remove(self, leaf: bytes) -> None:
        self._state = _sub(self._state, int.from_bytes(leaf, "little"))

    def advance(self, rollout_id: str, prev_hash: str, new_hash: str) -> None:
        """A committed event moved `rollout_id`'s head from `prev_hash` (``""``: the rollout's
        first event) to `new_hash`."""
        if prev_hash:
            self._remove(store_head_leaf(rollout_id, prev_hash))
        else:
            self.rollouts += 1
        self._add(store_head_leaf(rollout_id, new_hash))
        self.events += 1

    def state_bytes(self) -> bytes:
        """The 1024 lanes, little-endian: what the head hashes."""
        return self._state.to_bytes(STATE_BYTES, "little")

    def head(self) -> StoreHead:
        digest = hashlib.sha256(STORE_HEAD_DOMAIN + self.state_bytes()).hexdigest()
        return StoreHead(digest, self.rollouts, self.events)
