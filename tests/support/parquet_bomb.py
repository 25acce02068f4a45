"""A Parquet decompression bomb made from a real store file: one page of a few megabytes that
says, and holds, gigabytes once decompressed (what someone handing over a crafted store could
write). Used by tests/sinks/test_parquet_bounds.py and bench/fuzz_crafted_store.py.

`bomb_file` appends a GZIP data page (a deflate stream of zeros) to the file's data and points
one column chunk's metadata at it, rewriting the footer (the Thrift compact encoding of
parquet-format's ``FileMetaData``). Every other byte stays as the writer wrote it.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

__all__ = ["bomb_file", "gzip_zeros"]

# Thrift compact types.
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(
    13
)
Field = list[Any]  # [id, type, value]

_ZEROS: dict[int, bytes] = {}


def gzip_zeros(size: int) -> bytes:
    """A gzip stream (what Parquet's GZIP codec reads) of `size` zero bytes, built once."""
    if size not in _ZEROS:
        z = zlib.compressobj(9, zlib.DEFLATED, 31)
        chunk = bytes(1 << 24)
        parts, left = [], size
        while left:
            n = min(left, len(chunk))
            parts.append(z.compress(chunk[:n] if n < len(chunk) else chunk))
            left -= n
        _ZEROS[size] = b"".join(parts) + z.flush()
    return _ZEROS[size]


class _In:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int) -> Any:
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            self.pos += 8
            return self.data[self.pos - 8 : self.pos]
        if kind == _BINARY:
            n = self.varint()
            self.pos += n
            return self.data[self.pos - n : self.pos]
        if kind in (_LIST, _SET):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            elem = head & 0x0F
            items = [
                self.byte() == 1 if elem in (_TRUE, _FALSE) else self.value(elem)
                for _ in range(size)
            ]
            return (elem, items)
        if kind == _STRUCT:
            return self.struct()
        raise ValueError(f"thrift type {kind} not handled")

    def struct(self) -> list[Field]:
        fields: list[Field] = []
        last = 0
        while True:
            head = self.byte()
            if head == _STOP:
                return fields
            kind, delta = head & 0x0F, head >> 4
            fid = last + delta if delta else self.zigzag()
            last = fid
            fields.append([fid, kind, self.value(kind)])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _value(kind: int, value: Any) -> bytes:
    if kind == _BYTE:
        return bytes([value])
    if kind in (_I16, _I32, _I64):
        return _zigzag(value)
    if kind == _DOUBLE:
        return bytes(value)
    if kind == _BINARY:
        return _varint(len(value)) + bytes(value)
    if kind in (_LIST, _SET):
        elem, items = value
        head = (
            bytes([len(items) << 4 | elem])
            if len(items) < 15
            else bytes([0xF0 | elem]) + _varint(len(items))
        )
        if elem in (_TRUE, _FALSE):
            return head + bytes(1 if v else 2 for v in items)
        return head + b"".join(_value(elem, v) for v in items)
    if kind == _STRUCT:
        return _struct(value)
    raise ValueError(f"thrift type {kind} not handled")


def _struct(fields: list[Field]) -> bytes:
    out = bytearray()
    last = 0
    for fid, kind, value in sorted(fields, key=lambda f: f[0]):
        wire = (_TRUE if value else _FALSE) if kind in (_TRUE, _FALSE) else kind
        delta = fid - last
        out += bytes([delta << 4 | wire]) if 0 < delta <= 15 else bytes([wire]) + _zigzag(fid)
        if kind not in (_TRUE, _FALSE):
            out += _value(kind, value)
        last = fid
    out.append(_STOP)
    return bytes(out)


def _get(fields: list[Field], fid: int) -> Field | None:
    return next((f for f in fields if f[0] == fid), None)


def _need(fields: list[Field], fid: int) -> Any:
    found = _get(fields, fid)
    assert found is not None, f"no field {fid}"
    return found[2]


def _set(fields: list[Field], fid: int, kind: int, value: Any) -> None:
    found = _get(fields, fid)
    if found is None:
        fields.append([fid, kind, value])
    else:
        found[1], found[2] = kind, value


def bomb_file(
    path: Path, *, column: str | None = None, pages: int = 1, page_bytes: int = (1 << 31) - 1
) -> None:
    """Point one column chunk of the Parquet file `path` (the first named `column`, else the
    first) at `pages` new GZIP data pages of `page_bytes` zeros each, rewritten in place."""
    data = path.read_bytes()
    assert data[:4] == b"PAR1"
    assert data[-4:] == b"PAR1"
    (footer_len,) = struct.unpack("<I", data[-8:-4])
    body = data[: -8 - footer_len]
    meta = _In(data[-8 - footer_len : -8]).struct()
    groups = _get(meta, 4)
    assert groups is not None
    chunk_meta: list[Field] | None = None
    for group in groups[2][1]:
        for chunk in _need(group, 1)[1]:
            cm = _need(chunk, 3)
            name = b".".join(_need(cm, 3)[1]).decode()
            if chunk_meta is None and (column is None or name.split(".")[0] == column):
                chunk_meta = cm
                num_values = _need(cm, 5)
    assert chunk_meta is not None, f"no column {column!r} in {path}"
    stream = gzip_zeros(page_bytes)
    header = _struct(
        [
            [1, _I32, 0],  # DATA_PAGE
            [2, _I32, page_bytes],
            [3, _I32, len(stream)],
            [5, _STRUCT, [[1, _I32, num_values], [2, _I32, 0], [3, _I32, 3], [4, _I32, 3]]],
        ]
    )
    start = len(body)
    body += (header + stream) * pages
    _set(chunk_meta, 4, _I32, 2)  # GZIP
    _set(chunk_meta, 6, _I64, pages * (len(header) + page_bytes))
    _set(chunk_meta, 7, _I64, pages * (len(header) + len(stream)))
    _set(chunk_meta, 9, _I64, start)
    chunk_meta[:] = [f for f in chunk_meta if f[0] not in (10, 11)]  # no dictionary, no index
    footer = _struct(meta)
    path.write_bytes(body + footer + struct.pack("<I", len(footer)) + b"PAR1")
