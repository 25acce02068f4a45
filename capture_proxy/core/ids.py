"""Identifiers: call ids that sort by time, and rollout id checks."""

from __future__ import annotations

import os
import threading
import time

from ..schemas.records import ID_PATTERN

__all__ = ["new_call_id", "valid_rollout_id"]

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_lock = threading.Lock()
_last_ms = 0
_last_rand = 0


def _b32(value: int, length: int) -> str:
    out = []
    for _ in range(length):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_call_id(now_ms: int | None = None) -> str:
    """A ULID-shaped id (26 chars, Crockford base32): 48-bit milliseconds, 80 random bits.

    Ids made in the same millisecond by this process increase monotonically, so sorting call ids
    sorts calls by admission time, as `inspect` and manifests rely on.
    """
    global _last_ms, _last_rand
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    with _lock:
        if ms <= _last_ms:
            ms = _last_ms
            rand = (_last_rand + 1) & ((1 << 80) - 1)
        else:
            rand = int.from_bytes(os.urandom(10), "big") >> 1  # headroom for increments
        _last_ms, _last_rand = ms, rand
    return _b32(ms, 10) + _b32(rand, 16)


def valid_rollout_id(value: str) -> bool:
    return ID_PATTERN.fullmatch(value) is not None
