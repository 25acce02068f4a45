"""`MessageMemo`: what a rollout's earlier calls already computed for each message it re-sends.

An agent session re-sends its whole message history with every call, so turn ``n`` carries the
``n - 1`` turns before it unchanged. Two steps of every call hash each message: the record's
digest (`digest.message_digest`: the canonical encoding walked in Python, then SHA-256) and the
storage encoding (`sinks.codec.encode_record`: the message's JSON bytes, then the SHA-256 that
names its content-addressed blob). Both are pure functions of the message, so a memo keyed by the
message's JSON bytes (``orjson.dumps(message)``, exactly the bytes the stores keep as its blob,
computed in C at ~10 GB/s) lets each message be hashed once per rollout, and a call's cost follow
its new messages, not the length of its history.

Equal bytes mean an equal message, so a remembered value is exactly what the step would compute
again. (orjson writes NaN as ``null``; a message never holds one: requests are decoded from JSON,
which has none, and a request given as a Python mapping is validated by the request schema,
which types every field of a message.)

Bounded for hostile clients (docs/security.md): each rollout keeps at most `max_rollout_bytes` of
keys, the first ones it sent (a session's oldest messages are the ones every later call re-sends;
messages past the bound are hashed every time, as without a memo), and all rollouts together at
most `max_bytes`, the least recently used rollout dropped first. Every entry counts its bytes
plus a fixed overhead, so many tiny messages cannot grow it past the bound either. Safe to share
between threads: records are sealed on the event loop or a worker thread, and encoded on the
sinks' writer threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import orjson

from .digest import MessageDigester, message_digest

__all__ = ["ENTRY_OVERHEAD", "MessageMemo", "rollout_digester"]

V = TypeVar("V")

#: Bytes counted for each entry beside its key: its fingerprint, the dict slot, the tuple, the
#: value and the bytes objects' headers, a little over what CPython spends on them.
ENTRY_OVERHEAD = 320


def _fingerprint(data: bytes) -> bytes:
    """Length, head and tail of `data`: cheap to hash, and messages that share all three are
    rare (they are then told apart by comparing their bytes, and only the first is kept)."""
    return b"%d\0%b\0%b" % (len(data), data[:48], data[-48:])


class _Rollout(Generic[V]):
    __slots__ = ("bytes", "values")

    def __init__(self) -> None:
        #: fingerprint -> (the message's bytes, its value)
        self.values: dict[bytes, tuple[bytes, V]] = {}
        self.bytes = 0


class MessageMemo(Generic[V]):
    """Per rollout: a message's JSON bytes -> a value computed from them once."""

    def __init__(self, max_rollout_bytes: int = 8 * 2**20, max_bytes: int = 64 * 2**20) -> None:
        self.max_rollout_bytes = max_rollout_bytes
        self.max_bytes = max_bytes
        #: Bytes held now, overheads included, over all rollouts.
        self.bytes = 0
        #: Look-ups answered from the memo, and those that computed their value.
        self.hits = 0
        self.misses = 0
        self._rollouts: OrderedDict[str, _Rollout[V]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Entries held, over all rollouts."""
        with self._lock:
            return sum(len(r.values) for r in self._rollouts.values())

    def get(self, rollout_id: str, data: bytes, compute: Callable[[], V]) -> V:
        """The value remembered for `data` in `rollout_id`, else ``compute()`` (remembered while
        the rollout's share has room). An exception from `compute` propagates; nothing is kept."""
        # Looked up by a short fingerprint, then compared whole: hashing a 100 KB key (SipHash)
        # costs as much as the SHA-256 it would save, a memcmp a tenth of that.
        # Read without the lock: a dict look-up is atomic, and entries are never changed.
        tag = _fingerprint(data)
        rollout = self._rollouts.get(rollout_id)
        if rollout is not None:
            entry = rollout.values.get(tag)
            if entry is not None and entry[0] == data:
                self.hits += 1  # a figure for tests and benchmarks: a lost update is harmless
                return entry[1]
        # Computed outside the lock: two threads may both compute a new message, to equal values.
        value = compute()
        size = len(data) + ENTRY_OVERHEAD
        with self._lock:
            self.misses += 1
            if size > self.max_rollout_bytes:
                return value
            rollout = self._rollouts.get(rollout_id)
            if rollout is None:
                rollout = self._rollouts[rollout_id] = _Rollout()
            else:
                self._rollouts.move_to_end(rollout_id)
            # A fingerprint already taken (another message, or this one by another thread)
            # keeps its entry: the first messages of a session are the ones re-sent.
            if rollout.bytes + size > self.max_rollout_bytes or tag in rollout.values:
                return value
            # An exact-size copy: orjson's output keeps the capacity it grew to (~16 KB for a
            # 2 KB message), which the byte bound would not see.
            rollout.values[tag] = (bytes(memoryview(data)), value)
            rollout.bytes += size
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._rollouts.popitem(last=False)
                self.bytes -= old.bytes
        return value

    def __contains__(self, rollout_id: object) -> bool:
        """Whether `rollout_id` holds entries."""
        return rollout_id in self._rollouts

    def forget(self, rollout_id: str) -> None:
        """Drop what `rollout_id` holds (it was sealed or evicted: no more calls will come)."""
        with self._lock:
            old = self._rollouts.pop(rollout_id, None)
            if old is not None:
                self.bytes -= old.bytes


def rollout_digester(memo: MessageMemo[bytes], rollout_id: str) -> MessageDigester:
    """A `digest.MessageDigester` for the records of `rollout_id` that hashes each message the
    rollout re-sends once (`seal_record(..., digester=...)`)."""

    def digester(message: Mapping[str, Any], field: str) -> bytes:
        try:
            # Subclasses of str/int/dict/list are refused here, as the canonical encoder
            # refuses them: such a message takes the strict path and gets its error.
            data = orjson.dumps(message, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
        except (TypeError, orjson.JSONEncodeError):
            return message_digest(message, field=field)
        return memo.get(rollout_id, data, lambda: message_digest(message, field=field))

    return digester
