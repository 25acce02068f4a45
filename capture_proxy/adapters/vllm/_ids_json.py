"""Token ids as the JSON lists the token-in requests carry, encoded once.

A token-in call sends its prompt ids twice (to generate, then to derender), and a bridged prompt
is the previous call's prompt with a few hundred ids after it: encoding a 20k-id prompt costs
about 0.3 ms, copying its JSON a few microseconds. So a prompt's JSON is encoded once and sent
as it is, and a bridged prompt's JSON is the previous prompt's JSON extended
(`extend_ids_json`). The other way, a JSON list that mostly spells ids already known (the plain
rendering of a bridged prompt) is decoded only from where it differs (`ids_after_known`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import orjson

__all__ = [
    "common_prefix_len",
    "encode_ids",
    "extend_ids_json",
    "ids_after_known",
    "read_known_ids",
]

_decode_ids = msgspec.json.Decoder(list[int]).decode


def encode_ids(ids: Sequence[int]) -> bytes:
    """Token ids as a JSON list (compact)."""
    return orjson.dumps(ids if isinstance(ids, list) else list(ids))


def extend_ids_json(ids_json: bytes, more: Sequence[int]) -> bytes:
    """The JSON list of the ids of `ids_json` (a JSON list) followed by `more`: only `more` is
    encoded, the rest is copied as it is (a 20k-id prompt costs about 0.3 ms to encode)."""
    if not more:
        return ids_json
    head = ids_json.rstrip()
    if not (head.startswith(b"[") and head.endswith(b"]")):
        raise ValueError("ids_json is not a JSON list")
    head = head[:-1].rstrip()
    more_json = encode_ids(more)
    return head + (more_json[1:] if head == b"[" else b"," + more_json[1:])


def ids_after_known(ids: bytes, known: bytes, known_ids: Sequence[int]) -> list[int]:
    """The ids of the JSON list `ids`: `known_ids` as far as `ids` spells them byte for byte
    as the JSON list `known` does (every id before the first byte that differs), then the
    rest decoded. `msgspec.DecodeError` when that rest is not a list of ints."""
    return read_known_ids(ids, known, known_ids)[0]


def read_known_ids(ids: bytes, known: bytes, known_ids: Sequence[int]) -> tuple[list[int], int]:
    """`ids_after_known`, and how many of the ids at its start were read as `known_ids`' (the
    same bytes: the same ids; a lower bound of where the two lists first differ)."""
    shared = common_prefix_len(ids, known)
    if shared == len(ids) == len(known):
        return list(known_ids), len(known_ids)
    # Every id ending before the first difference is followed by a comma before it.
    whole = ids.count(b",", 0, shared)
    if whole == 0:
        return _decode_ids(ids), 0
    rest = _decode_ids(b"[" + ids[ids.rfind(b",", 0, shared) + 1 :])
    head = known_ids[:whole]
    return (head + rest if isinstance(head, list) else [*head, *rest]), whole


def common_prefix_len(a: bytes, b: bytes, start: int = 0) -> int:
    """How many bytes `a` from `start` on and `b` start with in common: blocks compared in C,
    then bytes."""
    n = min(len(a) - start, len(b))
    k = 0
    for block in (4096, 256, 16, 1):
        while k + block <= n and a[start + k : start + k + block] == b[k : k + block]:
            k += block
    return k
