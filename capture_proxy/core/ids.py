"""Identifiers: call ids nobody can guess, and rollout id checks.

Sandboxes see call ids (``X-Capture-Call-Id``) and may see rollout ids (the control API names a
rollout the driver did not name ``ro-`` + a lower-cased call id), and they run model-written
code: an id must not tell them the next one. Each id carries 80 bits from the
operating system's CSPRNG (`secrets`), drawn afresh for every id. The first 48 bits are the
creation time in milliseconds, so ids made in different milliseconds sort by time; ids made in
the same millisecond sort in no particular order (nothing relies on that order: manifests,
``inspect`` and trajectories order calls by ``seq``, rollouts by their creation time).
"""

from __future__ import annotations

import secrets
import time

from ..schemas.records import ID_PATTERN

__all__ = ["RANDOM_BITS", "new_call_id", "valid_rollout_id"]

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
#: Random bits in every id: guessing one id takes about 2**79 tries, however many ids were seen.
RANDOM_BITS = 80


def _b32(value: int, length: int) -> str:
    out = []
    for _ in range(length):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_call_id(now_ms: int | None = None) -> str:
    """A ULID-shaped id (26 chars, Crockford base32): 48-bit milliseconds, then 80 random bits.

    The random part is fresh for every id, never the previous id's plus one (the ULID spec's
    "monotonic" variant would make the next id in the same millisecond a guess away).
    """
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    return _b32(ms & ((1 << 48) - 1), 10) + _b32(secrets.randbits(RANDOM_BITS), 16)


def valid_rollout_id(value: str) -> bool:
    return ID_PATTERN.fullmatch(value) is not None
