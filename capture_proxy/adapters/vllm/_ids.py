"""Prompt token ids from vLLM's JSON, decoding only what the session has not sent before.

An agent session re-sends its whole history with every call, so the prompt of one call starts with
the previous call's prompt + completion: some 16k ids that were decoded a moment ago. Decoding
them again (a Python int per id, then an int32 array) is the largest single cost of reading a
vLLM answer. `PrefixCache` keeps, per session, the JSON text of the last call's prompt +
completion and its ids; `decode_prompt` finds how far the new prompt's bytes agree with that
text (C memcmp), takes the ids of the tokens that end before the last comma of the agreeing part
from the cache, and decodes only the rest, strictly.

Exact by construction: the cached text is the bytes of valid JSON int arrays, so a token whose
bytes (up to its comma) are equal is the same int; everything after is decoded as a list of ints
and refused otherwise. A different spelling (spaces, another server) just agrees less, down to
no prefix at all, and then the whole array is decoded as before.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from ._wire import decode_ids, encode, to_ids

__all__ = ["DEFAULT_PREFIX_CACHE_BYTES", "Prefix", "PrefixCache", "decode_prompt"]

#: Memory the cache may hold: about 200 KB per session for a 16k-token context.
DEFAULT_PREFIX_CACHE_BYTES = 64 * 2**20
_BLOCK = 4096
_decode_list = msgspec.json.Decoder(list[int]).decode
_COMMA = 0x2C
_CLOSE = 0x5D


@dataclass(frozen=True, slots=True)
class Prefix:
    """A session's last prompt + completion: its JSON text without the closing ``]``, its ids."""

    text: bytes
    ids: array[int]

    @property
    def size(self) -> int:
        return len(self.text) + 4 * len(self.ids)


def common_prefix_len(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix of two byte strings (compares blocks in C)."""
    n = min(len(a), len(b))
    lo = 0
    while lo + _BLOCK <= n and a[lo : lo + _BLOCK] == b[lo : lo + _BLOCK]:
        lo += _BLOCK
    hi = min(lo + _BLOCK, n)
    # a[:lo] == b[:lo]; the first difference, if any, is in [lo, hi): halve it.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def decode_prompt(field: str, raw: bytes, prefix: Prefix | None) -> array[int] | None:
    """The int32 ids of the JSON int array `raw` (None for ``null``), reusing `prefix`.

    Raises `msgspec.DecodeError` for anything but a JSON array of ints or null, and
    `CaptureExtractionError` for an id that does not fit in int32, as a full decode would.
    """
    if prefix is not None and raw[:1] == b"[":
        text = prefix.text
        n = len(text) if raw.startswith(text) else common_prefix_len(raw, text)
        if n == len(text) and n < len(raw) and raw[n] in (_COMMA, _CLOSE):
            known, cut = len(prefix.ids), n  # every cached token, complete
        else:
            # Tokens that end before the last comma both byte strings share are complete in both.
            cut = raw.rfind(b",", 0, n)
            known = raw.count(b",", 0, cut) + 1 if cut > 0 else 0
        if known:
            ids = prefix.ids[:known]
            if raw[cut] == _COMMA:
                tail = _decode_list(b"[" + raw[cut + 1 :])
                if not tail:
                    raise msgspec.DecodeError(f"{field}: a comma before the closing bracket")
                ids.extend(to_ids(field, tail))
            elif cut + 1 != len(raw):
                raise msgspec.DecodeError(f"{field}: trailing bytes after the array")
            return ids
    values = decode_ids(raw)
    return None if values is None else to_ids(field, values)


class PrefixCache:
    """Per session (a rollout id), the prefix its next prompt most likely starts with.

    Bounded by `max_bytes` (least recently used sessions are dropped first); a session that
    falls out just decodes its next prompt in full. Not thread-safe: one event loop uses it.
    """

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Prefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session: str | None) -> Prefix | None:
        if session is None:
            return None
        entry = self._entries.get(session)
        if entry is not None:
            self._entries.move_to_end(session)
        return entry

    def drop(self, session: str) -> None:
        """Forget a session that will send no more calls (sealed or idle rollout)."""
        old = self._entries.pop(session, None)
        if old is not None:
            self.bytes -= old.size

    def put(
        self, session: str | None, prompt_raw: bytes, prompt: array[int], completion: array[int]
    ) -> None:
        """Remember a call's prompt (its JSON bytes and ids) + completion for the session's next."""
        if session is None or self.max_bytes <= 0 or prompt_raw[-1:] != b"]":
            return
        head = prompt_raw[:-1]
        if completion:
            tail = encode(completion.tolist())[1:-1]  # compact, as vLLM writes token ids
            text = head + b"," + tail if prompt else head + tail
        else:
            text = head
        ids = array("i", prompt)
        ids.extend(completion)
        entry = Prefix(text, ids)
        if entry.size > self.max_bytes // 4:
            return  # one giant context would evict everyone else
        old = self._entries.pop(session, None)
        if old is not None:
            self.bytes -= old.size
        self._entries[session] = entry
        self.bytes += entry.size
        while self.bytes > self.max_bytes and self._entries:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size
