"""Routed experts as vLLM returns them, and the extras keys that say which positions a record holds.

vLLM started with ``--enable-return-routed-experts`` answers every choice with ``routed_experts``:
a base64 string of a NumPy ``.npy`` file whose first axis is the token position (prompt, then
output) and whose other axes are the MoE layers and the experts chosen per layer. A request's
``routed_experts_prompt_start: N`` limits it to positions ``N`` on. The proxy sends that index
when an earlier call of the rollout already staged the positions before it, so each record holds
only its new rows; these keys in the record's ``extras`` (covered by ``extras_digest``) say so:

- `EXPERTS_START` (``routed_experts_prompt_start``): the position of the record's first row
  (absent: 0, the record holds every position);
- `EXPERTS_PARENT` (``routed_experts_parent_call_id``): the call whose rows come before it;
- `EXPERTS_INCOMPLETE` (``routed_experts_incomplete``): true when the record's prompt does not
  start with the tokens that call's rows were routed for (the prompt drifted before the start),
  so no stored rows are this call's own for the positions before it.

Only the ``.npy`` framing is read here (format versions 1 to 3, C order, any dtype): the rows are
joined as bytes, never converted, so nothing needs NumPy.
"""

from __future__ import annotations

import ast
import base64
import binascii
import math
import struct
from dataclasses import dataclass

from ..errors import CaptureProxyError

__all__ = [
    "EXPERTS",
    "EXPERTS_INCOMPLETE",
    "EXPERTS_PARENT",
    "EXPERTS_START",
    "ExpertsFormatError",
    "NpyArray",
    "decode_npy",
    "encode_npy",
    "npy_rows",
]

EXPERTS = "routed_experts"
EXPERTS_START = "routed_experts_prompt_start"
EXPERTS_PARENT = "routed_experts_parent_call_id"
EXPERTS_INCOMPLETE = "routed_experts_incomplete"

_MAGIC = b"\x93NUMPY"
#: Bytes before the header text, and the header-length format, per .npy major version.
_PREAMBLE = {1: (10, "<H"), 2: (12, "<I"), 3: (12, "<I")}


class ExpertsFormatError(CaptureProxyError):
    """A ``routed_experts`` value is not a base64 ``.npy`` array this module can read."""


@dataclass(frozen=True, slots=True)
class NpyArray:
    """An ``.npy`` array as stored: its dtype string, shape and C-ordered data bytes."""

    descr: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def row_bytes(self) -> int:
        """Bytes per position (one step along the first axis)."""
        return _itemsize(self.descr) * math.prod(self.shape[1:])


def _itemsize(descr: str) -> int:
    # A simple dtype string: byte order, kind, size ("<i4", "|u1").
    size = descr.lstrip("<>|=")[1:]
    if not size.isdigit() or int(size) == 0:
        raise ExpertsFormatError(f"not a simple numeric dtype: {descr!r}")
    return int(size)


def _b64(encoded: object, chars: int | None = None) -> bytes:
    if not isinstance(encoded, str):
        raise ExpertsFormatError(f"expected a base64 string, got {type(encoded).__name__}")
    text = encoded if chars is None else encoded[:chars]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ExpertsFormatError(f"not base64: {exc}") from exc


def _header(raw: bytes) -> tuple[str, tuple[int, ...], int]:
    """``(descr, shape, data offset)`` from the start of an ``.npy`` file."""
    if raw[:6] != _MAGIC or len(raw) < 10 or raw[6] not in _PREAMBLE:
        raise ExpertsFormatError("not a .npy file (version 1 to 3)")
    offset, fmt = _PREAMBLE[raw[6]]
    if len(raw) < offset:
        raise ExpertsFormatError("truncated .npy header")
    (size,) = struct.unpack(fmt, raw[8:offset])
    text = raw[offset : offset + size]
    if len(text) < size:
        raise ExpertsFormatError("truncated .npy header")
    try:
        header = ast.literal_eval(text.decode("latin-1"))
        descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    except (ValueError, SyntaxError, KeyError, TypeError) as exc:
        raise ExpertsFormatError(f"unreadable .npy header: {exc}") from exc
    if not isinstance(descr, str) or fortran is not False:
        raise ExpertsFormatError(f"not a C-ordered array of a simple dtype: {header}")
    if not isinstance(shape, tuple) or not shape or not all(type(d) is int for d in shape):
        raise ExpertsFormatError(f"the array has no positions axis: shape {shape!r}")
    return descr, shape, offset + size


def npy_rows(encoded: object) -> int:
    """How many positions a ``routed_experts`` value holds, from its header only."""
    head = _b64(encoded, 16)  # 12 bytes: the magic, the version and the header's length
    if head[:6] != _MAGIC or len(head) < 12 or head[6] not in _PREAMBLE:
        raise ExpertsFormatError("not a .npy file (version 1 to 3)")
    offset, fmt = _PREAMBLE[head[6]]
    (size,) = struct.unpack(fmt, head[8:offset])
    need = offset + size
    _, shape, _ = _header(_b64(encoded, 4 * ((need + 2) // 3)))
    return shape[0]


def decode_npy(encoded: object) -> NpyArray:
    """The array of a ``routed_experts`` value (`ExpertsFormatError` if it is not one)."""
    raw = _b64(encoded)
    descr, shape, offset = _header(raw)
    data = raw[offset:]
    arr = NpyArray(descr, shape, data)
    if len(data) != arr.row_bytes * shape[0]:
        raise ExpertsFormatError(
            f"{len(data)} data bytes do not fill shape {shape} of dtype {descr!r}"
        )
    return arr


def encode_npy(arr: NpyArray) -> str:
    """`arr` as vLLM sends it: base64 of a version-1 ``.npy`` file."""
    dims = ", ".join(str(d) for d in arr.shape) + ("," if len(arr.shape) == 1 else "")
    header = f"{{'descr': {arr.descr!r}, 'fortran_order': False, 'shape': ({dims}), }}".encode()
    # The format pads the header with spaces and a newline so the data starts 64-byte aligned.
    pad = -(10 + len(header) + 1) % 64
    header += b" " * pad + b"\n"
    raw = _MAGIC + b"\x01\x00" + struct.pack("<H", len(header)) + header + arr.data
    return base64.b64encode(raw).decode()
