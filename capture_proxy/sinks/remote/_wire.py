"""The wire form of a store's records: a stream of length-prefixed msgpack frames.

A record travels as the row the SQLite and Parquet sinks store (`capture_proxy.sinks.codec`), so
the form is the storage encoding already proven by both sinks: token ids as little-endian int32
bytes, logprobs as float32 bytes, messages as content-addressed JSON blobs. Within one answer a
blob or an attachment is sent once (an agent's history and its images recur in every call), and
a call's tokens are sent as the tail after its parent's when the parent went earlier in the same
answer. The reader rebuilds each logical record from those pieces; its digest is recomputed there
(`capture_proxy.read.reader.Store`), never trusted from the sender.

Frames: a 4-byte big-endian length, then a msgpack map whose ``t`` says what it is:

- ``blob`` (``key``, ``data``), ``attachment`` (``sha256``, ``media_type``, ``data``): pieces
  later rows refer to;
- ``row`` (``row``): one record; its ``attachment_media_types`` give each attachment it refers
  to the media type its digest binds (an ``attachment`` frame is sent once per sha256, with the
  media type of its first use, and two calls may send the same bytes under two media types);
- ``keys`` (``keys``): a batch of staging keys;
- ``error`` (``status``, ``code``, ``param``, ``message``): the answer failed after it began;
- ``end`` (``count``): the answer is complete; a stream without it was cut short.

msgspec rather than Arrow IPC: a trainer reading a remote store must not need pyarrow (it never
imports it to read SQLite either), the rows are a handful of bytes columns that msgpack carries
as they are, and the nested request and response are JSON bytes either way.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from ...schemas.records import Attachment, StagedCallRecord
from ...schemas.tokens import full_sequence
from ..base import StoreError
from ..codec import decode_row, encode_record

__all__ = [
    "CONTENT_TYPE",
    "WIRE_VERSION",
    "RecordDecoder",
    "RecordEncoder",
    "WireError",
    "end_frame",
    "error_frame",
    "frame",
    "iter_frames",
    "keys_frame",
]

#: The media type of a frame stream.
CONTENT_TYPE = "application/vnd.capture-proxy.frames"
#: Bumped when a frame's meaning changes; the server states it at ``GET /admin/store``.
WIRE_VERSION = 1
#: A frame longer than this is refused: a record is bounded by the proxy's body limit, far less.
MAX_FRAME = 1 << 31
#: Calls whose prompt + completion the encoder keeps, to send the next calls as tails of theirs.
_PARENT_WINDOW = 64

_LENGTH = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict[str, Any])


class WireError(StoreError):
    """An answer from a remote store that cannot be read: cut short, or not in the wire form."""


def frame(obj: Mapping[str, Any]) -> bytes:
    data = _encoder.encode(obj)
    return _LENGTH.pack(len(data)) + data


def keys_frame(keys: list[str]) -> bytes:
    return frame({"t": "keys", "keys": keys})


def end_frame(count: int) -> bytes:
    return frame({"t": "end", "count": count})


def error_frame(status: int, code: str, message: str, param: str | None = None) -> bytes:
    return frame({"t": "error", "status": status, "code": code, "param": param, "message": message})


class RecordEncoder:
    """Frames for the records of one answer, in order (sans-IO: records in, bytes out)."""

    def __init__(self) -> None:
        self._blobs: set[str] = set()
        self._attachments: set[str] = set()
        self._fulls: dict[str, array[int]] = {}
        self.count = 0

    def encode(self, record: StagedCallRecord) -> bytes:
        parent = self._fulls.get(record.parent_call_id or "")
        encoded = encode_record(record, parent)
        out = bytearray()
        for key, data in encoded.blobs.items():
            if key not in self._blobs:
                self._blobs.add(key)
                out += frame({"t": "blob", "key": key, "data": data})
        for att in record.attachments:
            if att.sha256 not in self._attachments:
                self._attachments.add(att.sha256)
                out += frame(
                    {
                        "t": "attachment",
                        "sha256": att.sha256,
                        "media_type": att.media_type,
                        "data": att.data,
                    }
                )
        out += frame({"t": "row", "row": encoded.row})
        self._fulls[record.call_id] = encoded.full
        if len(self._fulls) > _PARENT_WINDOW:
            del self._fulls[next(iter(self._fulls))]
        self.count += 1
        return bytes(out)


class RecordDecoder:
    """Records back from the frames of one answer (sans-IO: frames in, records out).

    `feed` returns the record a ``row`` frame completes, None for the pieces before it. The
    records are rebuilt as they were staged; nothing here checks a digest.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self._blobs: dict[str, bytes] = {}
        self._attachments: dict[str, Attachment] = {}
        self._records: dict[str, StagedCallRecord] = {}

    def feed(self, msg: Mapping[str, Any]) -> StagedCallRecord | None:
        kind = msg.get("t")
        try:
            if kind == "blob":
                self._blobs[str(msg["key"])] = bytes(msg["data"])
                return None
            if kind == "attachment":
                att = Attachment(str(msg["sha256"]), str(msg["media_type"]), bytes(msg["data"]))
                self._attachments[att.sha256] = att
                return None
            if kind == "row":
                return self._row(msg["row"])
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"{self.where}: a {kind} frame cannot be read: {e}") from e
        raise WireError(f"{self.where}: unexpected frame {kind!r} among records")

    def _row(self, row: Mapping[str, Any]) -> StagedCallRecord:
        parent_full = None
        if int(row["prev_len"]):
            parent = self._records.get(str(row["parent_call_id"]))
            if parent is None:
                raise WireError(
                    f"{self.where}: call {row['call_id']} is sent as a tail of "
                    f"{row['parent_call_id']}, which the answer did not hold"
                )
            parent_full = full_sequence(parent.prompt_token_ids, parent.completion_token_ids)
        try:
            attachments = [self._attachments[sha] for sha in row["attachment_shas"]]
        except KeyError as e:
            raise WireError(f"{self.where}: attachment {e} was not sent before its call") from e
        record, _ = decode_row(row, self._blobs.__getitem__, parent_full, attachments)
        self._records[record.call_id] = record
        return record


def iter_frames(read: Callable[[int], bytes], where: str) -> Iterator[dict[str, Any]]:
    """The frames of a stream read with `read(n)` (returns fewer bytes only at its end), up to
    and without the ``end`` frame. Raises `WireError` when the stream ends before ``end``."""
    count = 0
    while True:
        head = read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            raise WireError(f"{where}: the answer was cut short after {count} frames")
        (length,) = _LENGTH.unpack(head)
        if length > MAX_FRAME:
            raise WireError(f"{where}: a frame of {length} bytes: not a capture-proxy answer")
        data = read(length)
        if len(data) < length:
            raise WireError(f"{where}: the answer was cut short after {count} frames")
        try:
            msg = _decoder.decode(data)
        except msgspec.DecodeError as e:
            raise WireError(f"{where}: an unreadable frame: {e}") from e
        if msg.get("t") == "end":
            return
        count += 1
        yield msg
