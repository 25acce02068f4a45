"""A long-lived reader's per-key index: where keys are (`Locator`) and packed ints per key
(`Packed`), each filed under an 8-byte hash of the key with no Python object per key.

Their bytes grow with the store (a hash per blob and attachment, the places of every sealed
rollout); all but the newest of them live in files mapped from the temporary folder
(`_spill.SpillingBytes`), so a proxy's memory does not grow with what it has written. What
stays in memory per key is nothing; per run of keys with one place, 12 bytes (`Locator`).
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator

from ._spill import SpillingBytes

__all__ = ["Locator", "Packed", "key_hash"]


def key_hash(key: str) -> bytes:
    """The 8 bytes a `Locator` or a `Packed` files `key` under."""
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


class Locator:
    """Where keys are, in about 9 bytes each: an 8-byte hash of each key (in memory until
    `spill_bytes` of them, then in a mapped file), and its (unit, row group) once per run of
    keys added with the same place (12 bytes a run, in memory: a unit's keys are added
    together, so a row group of ten keys costs 1.2 bytes a key of memory).

    A hash may collide (about once in 2**32 lookups on a store of 2**32 keys): `find` yields
    every candidate, and the caller checks the row it reads.
    """

    __slots__ = ("_hashes", "_places", "_starts")

    def __init__(self, spill_bytes: int | None = None) -> None:
        self._hashes = SpillingBytes(spill_bytes)
        self._starts = array("I")  # the first key of each run of keys with one place
        self._places = array("Q")  # each run's place, ``unit << 32 | group``

    def __len__(self) -> int:
        return len(self._hashes) // 8

    def add(self, key: str, unit: int, group: int) -> None:
        place = unit << 32 | group
        if not self._places or self._places[-1] != place:
            # The run before the hash: a `find` on another thread places every hash it meets.
            self._starts.append(len(self))
            self._places.append(place)
        self._hashes.append(key_hash(key))

    def nbytes(self) -> int:
        """Bytes held in memory (the hashes not yet in a file, and the runs' places)."""
        runs = self._starts.itemsize * len(self._starts) + self._places.itemsize * len(self._places)
        return self._hashes.memory_bytes() + runs

    def files(self) -> int:
        """Files the hashes are mapped from."""
        return self._hashes.files()

    def find(self, key: str, *, newest_first: bool = False) -> Iterator[tuple[int, int]]:
        """The (unit, group) places filed under `key`'s hash, oldest (or newest) first."""
        # A C scan of the hashes (about 1 ms per million keys, page cache for the mapped part).
        for pos in self._hashes.find_aligned(key_hash(key), 8, newest_first=newest_first):
            place = self._places[bisect_right(self._starts, pos // 8) - 1]
            yield place >> 32, place & 0xFFFFFFFF


class Packed:
    """Packed ints per key, filed under an 8-byte hash of the key: no Python object per key.
    For what a reader rarely asks for (the places of sealed rollouts' rows). A hash may collide:
    `find` returns the values of every key filed under the same hash, and the caller checks the
    rows it reads.

    Each value is split into its high part (``value >> low_bits``) and its low part; the high
    part is stored as the difference from the key's previous value's, the low part as it is,
    both as variable-length ints (LEB128; the difference zigzag-encoded, so any order of values
    round-trips). A rollout's places are ascending unit positions a few units apart: about 2-3
    bytes a place, and 16 bytes per `add` (its hash and where its values end). Both move to
    mapped files past `spill_bytes` (`Locator`).
    """

    __slots__ = ("_entries", "_low_bits", "_values")

    def __init__(self, low_bits: int = 0, spill_bytes: int | None = None) -> None:
        self._low_bits = low_bits
        #: per `add`: the key's hash, then where its values end in `_values` (8 bytes, LE)
        self._entries = SpillingBytes(spill_bytes)
        self._values = SpillingBytes(spill_bytes)

    def __len__(self) -> int:
        return len(self._entries) // 16

    def add(self, key: str, values: Iterable[int]) -> None:
        out, shift, mask, prev = bytearray(), self._low_bits, (1 << self._low_bits) - 1, 0
        for v in values:
            high = v >> shift
            delta, prev = high - prev, high
            _put_varint(out, delta << 1 if delta >= 0 else (-delta << 1) - 1)
            if shift:
                _put_varint(out, v & mask)
        self._values.append(out)
        # The entry last: a `find` on another thread meets the key once its values are in.
        self._entries.append(key_hash(key) + len(self._values).to_bytes(8, "little"))

    def nbytes(self) -> int:
        """Bytes held in memory (what is not yet in a file)."""
        return self._entries.memory_bytes() + self._values.memory_bytes()

    def find(self, key: str) -> list[int]:
        """The values added under `key`'s hash, in the order they were added."""
        out: list[int] = []
        for pos in self._entries.find_aligned(key_hash(key), 16):
            end = int.from_bytes(self._entries.read(pos + 8, pos + 16), "little")
            start = int.from_bytes(self._entries.read(pos - 8, pos), "little") if pos else 0
            out.extend(self._decode(self._values.read(start, end)))
        return out

    def _decode(self, data: bytes) -> list[int]:
        shift, out, prev, i = self._low_bits, [], 0, 0
        while i < len(data):
            z, i = _get_varint(data, i)
            prev += (z >> 1) ^ -(z & 1)
            low = 0
            if shift:
                low, i = _get_varint(data, i)
            out.append(prev << shift | low)
        return out


def _put_varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)


def _get_varint(data: bytes, i: int) -> tuple[int, int]:
    """The int at `i` and where the next one starts."""
    n = shift = 0
    while True:
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7
