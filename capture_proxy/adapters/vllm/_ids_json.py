"""Token ids as the JSON lists the token-in requests carry, encoded once.

A token-in call sends its prompt ids twice (to generate, then to derender), and a bridged prompt
is the previous call's prompt with a few hundred ids after it: encoding a 20k-id prompt costs
about 0.3 ms, copying its JSON a few microseconds. So a prompt's JSON is encoded once and sent
as it is, and a bridged prompt's JSON is the previous prompt's JSON extended
(`extend_ids_json`).
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

__all__ = ["encode_ids", "extend_ids_json"]


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
