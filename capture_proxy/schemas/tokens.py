"""Token-sequence helpers for the capture core and the sinks (no I/O, no per-token objects)."""

from __future__ import annotations

from array import array

__all__ = ["common_prefix_len", "full_sequence"]


def full_sequence(prompt: array[int], completion: array[int]) -> array[int]:
    """prompt + completion as one int32 array: what the next turn's prompt should extend."""
    seq = array("i", prompt)
    seq.extend(completion)
    return seq


def common_prefix_len(a: array[int], b: array[int]) -> int:
    """Length of the longest common prefix of two int32 arrays.

    Compares byte blocks in C, then at most 1024 tokens in Python.
    """
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ba = a.tobytes()
    bb = b.tobytes()
    if ba[: 4 * n] == bb[: 4 * n]:
        return n
    # Find the first differing 4 KiB block by comparing whole blocks (memcmp in C), then the
    # token inside it: avoids a Python loop over every token of a 16k-token prompt.
    block = 4096
    start = 0
    while ba[start : start + block] == bb[start : start + block]:
        start += block
    i = start // 4
    while a[i] == b[i]:
        i += 1
    return i
