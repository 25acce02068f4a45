"""The ``.npy`` framing of routed experts: read without NumPy, refused when it is not one."""

from __future__ import annotations

import base64
import struct

import pytest

from capture_proxy.schemas.experts import (
    ExpertsFormatError,
    NpyArray,
    decode_npy,
    encode_npy,
    npy_rows,
)
from capture_proxy.testing.fake_vllm._experts import encode_experts, experts_for, read_experts


def _npy(header: bytes, data: bytes = b"", version: int = 1) -> str:
    size = struct.pack("<H" if version == 1 else "<I", len(header))
    return base64.b64encode(b"\x93NUMPY" + bytes([version, 0]) + size + header + data).decode()


def test_rows_and_arrays_read_as_vllm_sends_them() -> None:
    ids = list(range(37))
    encoded = encode_experts(experts_for(ids))
    assert npy_rows(encoded) == 37
    arr = decode_npy(encoded)
    assert (arr.descr, arr.shape, arr.row_bytes) == ("<i4", (37, 2, 2), 16)
    assert encode_npy(arr) == encoded
    assert read_experts(encode_npy(NpyArray("<i4", (0, 2, 2), b"")))[0] == (0, 2, 2)


def test_version_2_headers_and_other_dtypes_read_too() -> None:
    header = b"{'descr': '|u1', 'fortran_order': False, 'shape': (3, 4), }\n"
    encoded = _npy(header, bytes(range(12)), version=2)
    assert npy_rows(encoded) == 3
    arr = decode_npy(encoded)
    assert (arr.shape, arr.row_bytes, arr.data) == ((3, 4), 4, bytes(range(12)))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "base64 string"),
        ("@@@@", "not base64"),
        (base64.b64encode(b"PK\x03\x04 not an npy file").decode(), "not a .npy"),
        (_npy(b"{'descr': '<i4'"), "unreadable"),
        (_npy(b"{'descr': '<i4', 'fortran_order': True, 'shape': (1,), }"), "C-ordered"),
        (_npy(b"{'descr': '<i4', 'fortran_order': False, 'shape': (), }"), "positions"),
        (_npy(b"{'descr': 'O', 'fortran_order': False, 'shape': (1,), }"), "dtype"),
        (_npy(b"{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), }", b"\0" * 8), "fill"),
        (base64.b64encode(b"\x93NUMPY\x01\x00\xff\x00{").decode(), "truncated"),
    ],
)
def test_what_is_not_an_npy_array_is_refused(value: object, message: str) -> None:
    with pytest.raises(ExpertsFormatError, match=message):
        decode_npy(value)


def test_counting_rows_reads_only_the_header_and_refuses_what_is_not_one() -> None:
    header = b"{'descr': '<i4', 'fortran_order': False, 'shape': (5, 2, 2), }\n"
    assert npy_rows(_npy(header)) == 5  # the data is not read (here: not even there)
    for value in (base64.b64encode(b"\x93NUMPY").decode(), _npy(b"{'shape': (5,)}"), 7):
        with pytest.raises(ExpertsFormatError):
            npy_rows(value)
