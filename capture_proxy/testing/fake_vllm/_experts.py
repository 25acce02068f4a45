"""Routed experts as a vLLM started with ``--enable-return-routed-experts`` returns them.

vLLM sends them per choice as ``routed_experts``: a base64 string of a NumPy ``.npy`` file, an
int32 array of shape ``(positions, layers, top_k)`` (the experts each token was routed to, per
MoE layer), over the prompt and output positions; ``routed_experts_prompt_start: N`` in the
request limits it to positions from ``N`` on. The fake routes deterministically, from each
position's token id and index, so a test can rebuild the experts of any position: the fake's
experts for positions ``start..end`` of a sequence are ``experts_for(ids, start)``.

Written without NumPy (the fake imports nothing it does not need); `read_experts` reads them back.
"""

from __future__ import annotations

import ast
import base64
import struct
from array import array

__all__ = ["LAYERS", "TOP_K", "encode_experts", "experts_for", "read_experts"]

#: The fake model's MoE shape: layers, and experts chosen per token and layer (of 8).
LAYERS = 2
TOP_K = 2
_EXPERTS = 8
_MAGIC = b"\x93NUMPY\x01\x00"


def experts_for(ids: list[int], start: int = 0) -> list[int]:
    """The flat int32 experts of positions ``start..len(ids)`` (row-major: position, layer, k)."""
    out: list[int] = []
    for pos in range(max(0, start), len(ids)):
        for layer in range(LAYERS):
            first = (ids[pos] * 31 + pos * 7 + layer * 3) % _EXPERTS
            out.extend((first + k) % _EXPERTS for k in range(TOP_K))
    return out


def encode_experts(flat: list[int]) -> str:
    """`flat` experts as vLLM sends them: base64 of a ``.npy`` of shape (n, LAYERS, TOP_K)."""
    rows = len(flat) // (LAYERS * TOP_K)
    header = (
        f"{{'descr': '<i4', 'fortran_order': False, 'shape': ({rows}, {LAYERS}, {TOP_K}), }}"
    ).encode()
    # The .npy format pads the header with spaces and a newline to a multiple of 64 bytes.
    pad = 64 - (len(_MAGIC) + 2 + len(header) + 1) % 64
    header += b" " * (pad % 64) + b"\n"
    data = array("i", flat)
    if data.itemsize != 4 or struct.pack("=i", 1) != struct.pack("<i", 1):
        raise RuntimeError("the fake writes little-endian int32 experts only")
    npy = _MAGIC + struct.pack("<H", len(header)) + header + data.tobytes()
    return base64.b64encode(npy).decode()


def read_experts(encoded: str) -> tuple[tuple[int, ...], list[int]]:
    """``(shape, flat values)`` of a ``routed_experts`` string (int32 ``.npy``, version 1)."""
    raw = base64.b64decode(encoded)
    if raw[:8] != _MAGIC:
        raise ValueError("not a version-1 .npy file")
    (size,) = struct.unpack("<H", raw[8:10])
    header = ast.literal_eval(raw[10 : 10 + size].decode())
    if header["descr"] != "<i4" or header["fortran_order"]:
        raise ValueError(f"not a C-ordered little-endian int32 array: {header}")
    values = array("i")
    values.frombytes(raw[10 + size :])
    return tuple(header["shape"]), values.tolist()
