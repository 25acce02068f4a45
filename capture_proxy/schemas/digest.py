"""Digests: SHA-256 over a versioned, length-delimited, typed binary encoding.

The byte layout is specified in ``docs/digest.md`` with a worked vector; this module is its only
implementation, and golden vectors in ``tests/schemas/test_digest.py`` pin it. JSON text is never
hashed: the same value has many JSON spellings, but exactly one encoding here.

Value encoding (all integers little-endian):

====  ===========================================================================
tag   payload
====  ===========================================================================
N     null
F/T   false / true
I     int64
D     float64 (IEEE-754 bits; NaN and infinities are refused)
S     u64 byte length, UTF-8 bytes
B     u64 byte length, bytes
L     u64 count, items
M     u64 count, (S-encoded key, value) pairs sorted by the key's UTF-8 bytes
H     32 bytes: the SHA-256 of a sub-structure (a message)
i     u64 count, int32 values (token ids)
f     u64 count, float32 bit patterns (logprobs)
====  ===========================================================================

The record digest hashes ``b"capture-proxy:record:v<N>\\0"`` followed by each field of the
record's encoding (`RECORD_FIELDS` for digest version 2, `RECORD_FIELDS_V1` for version 1), in that
order, as an S-encoded name then the encoded value. The encoding is chosen by the record's
`schema_version` (`StagedCallRecord.digest_version`), so records sealed by an older release keep
verifying. In the request, the ``messages`` list is encoded as a list of ``H`` message digests
(each the SHA-256 of ``b"capture-proxy:message:v1\\0"`` + the message's encoding): a message that
recurs in every later call of a session is hashed (and stored) once. Version 2 also binds each
attachment's media type, beside its sha256, in the record digest.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any

import orjson

from ..errors import CaptureProxyError
from .records import Attachment, RecordValidationError, StagedCallRecord
from .version import DIGEST_VERSION

__all__ = [
    "RECORD_FIELDS",
    "RECORD_FIELDS_V1",
    "DigestMismatch",
    "EncodingError",
    "MessageDigestCache",
    "RequestValueCache",
    "encode_request",
    "encode_value",
    "extras_digest",
    "has_null_token",
    "message_digest",
    "record_digest",
    "seal_record",
    "verify_record",
]

RECORD_DOMAIN = b"capture-proxy:record:v%d\x00" % DIGEST_VERSION
#: Version 2 changed only the record's encoding: messages and extras encode as in version 1, so
#: their domains (and every digest a cache holds) are shared by both versions.
EXTRAS_DOMAIN = b"capture-proxy:extras:v1\x00"
MESSAGE_DOMAIN = b"capture-proxy:message:v1\x00"

#: The fields a version-1 record digest covers, in encoding order. Attachments are not here: the
#: request names each by sha256, which binds the bytes to the record.
RECORD_FIELDS_V1 = (
    "schema_version",
    "rollout_id",
    "call_id",
    "parent_call_id",
    "seq",
    "retry_of",
    "created_at_ms",
    "weight_version",
    "model",
    "upstream_version",
    "tokenizer_fingerprint",
    "sampling",
    "finish_reason",
    "request",
    "response",
    "prompt_token_ids",
    "completion_token_ids",
    "completion_logprobs",
    "extras_digest",
)
#: The fields a version-2 record digest covers: version 1's, then the fields of record schema 2,
#: then ``attachments``: ``[sha256, media_type]`` per attachment, in order of first reference.
RECORD_FIELDS = (
    *RECORD_FIELDS_V1,
    "engine_weight_version",
    "weight_spans",
    "token_in",
    "bridge_spans",
    "replica",
    "effective_sampling",
    "logprobs_mode",
    "attachments",
)
_FIELDS_OF = {1: RECORD_FIELDS_V1, 2: RECORD_FIELDS}

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_u64 = struct.Struct("<Q").pack
_i64 = struct.Struct("<q").pack
_f64 = struct.Struct("<d").pack
_LITTLE = sys.byteorder == "little"


class EncodingError(RecordValidationError):
    """A value has no canonical encoding (NaN, a non-string key, an int beyond int64, ...)."""


class DigestMismatch(CaptureProxyError, ValueError):
    """Stored bytes do not hash to the digest stored with them: the record was altered."""

    def __init__(self, key: str, what: str, expected: str, actual: str) -> None:
        super().__init__(f"{key}: {what} mismatch (stored {expected}, computed {actual})")
        self.key = key
        self.what = what


class _Fail(Exception):
    """Raised deep in the encoder; the path is prepended while unwinding (free on success)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message


def _le_bytes(values: array[Any]) -> bytes:
    if _LITTLE:
        return values.tobytes()
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()


def _encode(v: Any, out: list[bytes]) -> None:
    # Exact type checks first: bool is a subclass of int and must not encode as one.
    t = type(v)
    if t is str:
        try:
            b = v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _Fail("", "string is not valid UTF-8 (lone surrogate)") from exc
        out.append(b"S")
        out.append(_u64(len(b)))
        out.append(b)
    elif v is None:
        out.append(b"N")
    elif v is True:
        out.append(b"T")
    elif v is False:
        out.append(b"F")
    elif t is int:
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise _Fail("", f"integer {v} does not fit in int64")
        out.append(b"I")
        out.append(_i64(v))
    elif t is float:
        if not math.isfinite(v):
            raise _Fail("", f"float {v} has no canonical encoding (NaN/infinity)")
        out.append(b"D")
        out.append(_f64(v))
    elif isinstance(v, Mapping):
        items = []
        for k in v:
            if type(k) is not str:
                raise _Fail("", f"map key {k!r:.40} is not a string")
            try:
                items.append((k.encode("utf-8"), k))
            except UnicodeEncodeError as exc:
                raise _Fail(f".{k!r}", "map key is not valid UTF-8 (lone surrogate)") from exc
        items.sort()
        out.append(b"M")
        out.append(_u64(len(items)))
        for kb, k in items:
            out.append(b"S")
            out.append(_u64(len(kb)))
            out.append(kb)
            try:
                _encode(v[k], out)
            except _Fail as e:
                raise _Fail(f".{k}{e.path}", e.message) from e
    elif t is list or t is tuple:
        out.append(b"L")
        out.append(_u64(len(v)))
        for i, item in enumerate(v):
            try:
                _encode(item, out)
            except _Fail as e:
                raise _Fail(f"[{i}]{e.path}", e.message) from e
    elif t is array and v.typecode == "i":
        out.append(b"i")
        out.append(_u64(len(v)))
        out.append(_le_bytes(v))
    elif t is array and v.typecode == "f":
        out.append(b"f")
        out.append(_u64(len(v)))
        out.append(_le_bytes(v))
    elif t is bytes:
        out.append(b"B")
        out.append(_u64(len(v)))
        out.append(v)
    else:
        raise _Fail("", f"{t.__name__} has no canonical encoding")


def encode_value(value: Any, *, field: str = "value") -> bytes:
    """The canonical encoding of a JSON-like value (or a token/logprob array)."""
    out: list[bytes] = []
    try:
        _encode(value, out)
    except _Fail as e:
        raise EncodingError(f"{field}{e.path}", e.message) from e
    return b"".join(out)


def message_digest(message: Mapping[str, Any], *, field: str = "message") -> bytes:
    """The raw SHA-256 of one chat message; the request encodes its messages as these."""
    return hashlib.sha256(MESSAGE_DOMAIN + encode_value(message, field=field)).digest()


def extras_digest(extras: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the extras' canonical encoding (routed_experts, media_spans, ...)."""
    return hashlib.sha256(EXTRAS_DOMAIN + encode_value(extras, field="extras")).hexdigest()


MessageDigester = Callable[[Mapping[str, Any], str], bytes]


def _default_digester(message: Mapping[str, Any], field: str) -> bytes:
    return message_digest(message, field=field)


def _bad_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


#: The canonical encoding of one request value, given its field name (for error paths).
ValueEncoder = Callable[[Any, str], bytes]


def _encode_request(
    request: Mapping[str, Any],
    out: list[bytes],
    digester: MessageDigester,
    encoder: ValueEncoder | None = None,
) -> None:
    messages = request.get("messages")
    if not isinstance(messages, list):
        raise EncodingError("request.messages", "must be a list of messages")
    rest = {k: v for k, v in request.items() if k != "messages"}
    rest["messages"] = None  # placeholder keeps the key's sort position
    for k in rest:
        if type(k) is not str or (not k.isascii() and _bad_utf8(k)):
            raise EncodingError(f"request.{k!r}", "map key is not a valid UTF-8 string")
    keys = sorted(rest, key=lambda k: k.encode("utf-8"))
    out.append(b"M")
    out.append(_u64(len(keys)))
    for k in keys:
        kb = k.encode("utf-8")
        out.append(b"S")
        out.append(_u64(len(kb)))
        out.append(kb)
        if k == "messages":
            out.append(b"L")
            out.append(_u64(len(messages)))
            for i, m in enumerate(messages):
                if not isinstance(m, Mapping):
                    raise EncodingError(f"request.messages[{i}]", "must be an object")
                out.append(b"H")
                out.append(digester(m, f"request.messages[{i}]"))
        elif encoder is not None and type(rest[k]) in (dict, list):
            out.append(encoder(rest[k], f"request.{k}"))
        else:
            try:
                _encode(rest[k], out)
            except _Fail as e:
                raise EncodingError(f"request.{k}{e.path}", e.message) from e


def encode_request(
    request: Mapping[str, Any],
    *,
    digester: MessageDigester = _default_digester,
    encoder: ValueEncoder | None = None,
) -> bytes:
    """The request's part of a record's digest: the bytes `record_digest` hashes for the field
    ``request`` (both digest versions encode it alike). It depends on the request alone, so a
    caller can compute it before the answer exists (the proxy does, while the upstream
    generates) and pass it as `request_part`. Raises `EncodingError`, as `record_digest` would.
    """
    out: list[bytes] = []
    _encode_request(request, out, digester, encoder)
    return b"".join(out)


def record_digest(
    record: StagedCallRecord,
    *,
    extras_hex: str | None = None,
    digester: MessageDigester = _default_digester,
    encoder: ValueEncoder | None = None,
    media_types: Mapping[str, str] | None = None,
    request_part: bytes | None = None,
) -> str:
    """Hex SHA-256 of the record's logical content (see the module docs for the layout).

    The encoding is the record's own (`StagedCallRecord.digest_version`). Version 2 binds the
    media type of each attachment the request refers to: from `media_types` (sha256 -> media
    type) when given, else from ``record.attachments``; a reference with neither raises
    `EncodingError` naming it. `digester` lets a caller that has already hashed a session's
    earlier messages reuse them; `encoder` (a `RequestValueCache`) likewise the encodings of
    large request values. `request_part` is ``encode_request(record.request)`` when the caller
    has it already: it must be of this very request (it is hashed as given, not checked).
    """
    version = record.digest_version
    out: list[bytes] = [b"capture-proxy:record:v%d\x00" % version]
    for name in _FIELDS_OF[version]:
        nb = name.encode()
        out.append(b"S")
        out.append(_u64(len(nb)))
        out.append(nb)
        if name == "request":
            if request_part is not None:
                out.append(request_part)
            else:
                _encode_request(record.request, out, digester, encoder)
            continue
        if name == "attachments":
            value: Any = _attachment_types(record, media_types)
        elif name == "extras_digest" and extras_hex is not None:
            value = extras_hex
        else:
            value = getattr(record, name)
        try:
            _encode(value, out)
        except _Fail as e:
            raise EncodingError(f"{name}{e.path}", e.message) from e
    # One update over the joined parts: hashing ~1,500 small parts one call at a time costs
    # more than copying them once (the token arrays dominate the bytes either way).
    return hashlib.sha256(b"".join(out)).hexdigest()


def _attachment_types(
    record: StagedCallRecord, media_types: Mapping[str, str] | None
) -> list[list[str]]:
    known = (
        media_types
        if media_types is not None
        else {a.sha256: a.media_type for a in record.attachments}
    )
    out = []
    for sha in dict.fromkeys(record.attachment_refs()):
        media_type = known.get(sha)
        if media_type is None:
            raise EncodingError(
                "attachments",
                f"the request refers to attachment {sha}, but its media type was not given "
                "(pass the attachment to seal the record)",
            )
        out.append([sha, media_type])
    return out


def seal_record(
    record: StagedCallRecord,
    *,
    attachments: Mapping[str, Attachment] | None = None,
    digester: MessageDigester = _default_digester,
    encoder: ValueEncoder | None = None,
    request_part: bytes | None = None,
) -> StagedCallRecord:
    """A copy of `record` with `extras_digest` and `digest` computed. Raises `EncodingError`.

    `attachments` (sha256 -> attachment) are the attachments staged with the record, which a
    version-2 digest binds by media type; without them, ``record.attachments`` are used.
    `request_part`: the request's encoding computed ahead (`encode_request`, see `record_digest`).
    """
    ex = extras_digest(record.extras)
    types = None if attachments is None else {k: a.media_type for k, a in attachments.items()}
    digest = record_digest(
        record,
        extras_hex=ex,
        digester=digester,
        encoder=encoder,
        media_types=types,
        request_part=request_part,
    )
    return _with_digests(record, digest, ex)


_RECORD_ATTRS = tuple(f.name for f in fields(StagedCallRecord))


def _with_digests(record: StagedCallRecord, digest: str, extras_hex: str) -> StagedCallRecord:
    # `record` was validated when it was built and is frozen: `dataclasses.replace` would
    # validate every token id and logprob again only to set two strings.
    if type(record) is not StagedCallRecord:
        return replace(record, extras_digest=extras_hex, digest=digest)
    sealed = object.__new__(StagedCallRecord)
    for name in _RECORD_ATTRS:
        object.__setattr__(sealed, name, getattr(record, name))
    object.__setattr__(sealed, "extras_digest", extras_hex)
    object.__setattr__(sealed, "digest", digest)
    return sealed


class RequestValueCache:
    """A `ValueEncoder` that encodes each distinct large request value once.

    Every call of an agent session re-sends the same tool definitions (10-20 KB of nested JSON
    Schema), and walking them in Python is most of a request's digest. Entries are keyed by the
    value's sorted-key JSON bytes (computed in C): equal bytes mean an equal value, and so the
    same canonical encoding, with one exception this class rules out: orjson writes NaN and
    infinities as ``null``, so a value whose JSON holds a ``null`` token is never cached. Values
    under `min_bytes` of JSON are encoded directly (caching them would not pay).

    Bounded by count and by size: at most `max_entries` are kept and at most `max_bytes` of keys
    and encodings together, least recently used dropped first; a value whose entry would take
    over a quarter of `max_bytes` is never kept (one huge value would evict every session's
    tools, and is rarely sent twice). Safe to share between threads (records of large requests
    are sealed on worker threads).
    """

    def __init__(
        self, max_entries: int = 64, min_bytes: int = 512, max_bytes: int = 16 * 2**20
    ) -> None:
        self.max_entries = max_entries
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        #: Bytes of keys and encodings held now.
        self.bytes = 0
        self._encodings: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._encodings)

    def __call__(self, value: Any, field: str) -> bytes:
        try:
            key = orjson.dumps(value, option=_CACHE_KEY_OPTIONS)
        except (TypeError, orjson.JSONEncodeError):
            return encode_value(value, field=field)  # the encoder names the problem
        if len(key) < self.min_bytes or has_null_token(key):
            return encode_value(value, field=field)
        with self._lock:
            encoded = self._encodings.get(key)
            if encoded is not None:
                self._encodings.move_to_end(key)
                return encoded
        # Encoded outside the lock: two threads may both encode a new value, to equal bytes.
        encoded = encode_value(value, field=field)
        size = len(key) + len(encoded)
        if size > self.max_bytes // 4:
            return encoded
        with self._lock:
            if key not in self._encodings:
                self._encodings[key] = encoded
                self.bytes += size
                while len(self._encodings) > self.max_entries or self.bytes > self.max_bytes:
                    old_key, old = self._encodings.popitem(last=False)
                    self.bytes -= len(old_key) + len(old)
        return encoded


#: Subclasses of str/int/dict/list are refused, as the canonical encoder refuses them.
_CACHE_KEY_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_SUBCLASS


def has_null_token(key: bytes) -> bool:
    """True if compact JSON `key` holds a null token (first, or after ``:``, ``[`` or ``,``),
    which could have been a NaN; a "null" inside a string only costs a cache miss."""
    at = key.find(b"null")
    while at >= 0:
        if at == 0 or key[at - 1] in b":[,":
            return True
        at = key.find(b"null", at + 4)
    return False


class MessageDigestCache:
    """A `MessageDigester` that hashes each distinct message once.

    A session re-sends its whole history with every call, so verifying (or sealing) a rollout
    would otherwise encode its first messages once per call. Entries are keyed by the message's
    sorted-key JSON bytes (computed in C): equal bytes mean an equal message, so the cached digest
    is exactly what `message_digest` would return. (orjson writes NaN as ``null``, but records
    only ever hold values decoded from JSON, which has no NaN, and a miss is encoded strictly.)
    Bounded by count (`max_entries`) and by the bytes of its keys (`max_bytes`): cleared when
    either is full; a message over a quarter of `max_bytes` is hashed but never kept.
    """

    def __init__(self, max_entries: int = 100_000, max_bytes: int = 64 * 2**20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        #: Bytes of keys held now.
        self.bytes = 0
        self._digests: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._digests)

    def __call__(self, message: Mapping[str, Any], field: str) -> bytes:
        try:
            key = orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
        except (TypeError, orjson.JSONEncodeError):
            return message_digest(message, field=field)  # let the encoder name the problem
        digest = self._digests.get(key)
        if digest is None:
            digest = message_digest(message, field=field)
            if len(key) > self.max_bytes // 4:
                return digest
            if len(self._digests) >= self.max_entries or self.bytes + len(key) > self.max_bytes:
                self._digests.clear()
                self.bytes = 0
            self._digests[key] = digest
            self.bytes += len(key)
        return digest


def verify_record(
    record: StagedCallRecord,
    *,
    digester: MessageDigester = _default_digester,
    encoder: ValueEncoder | None = None,
) -> None:
    """Raise `DigestMismatch` unless the record's content and attachments match its digests.

    The digest is recomputed with the record's own encoding (version 1 or 2, from its
    `schema_version`); version 2 also binds each attachment's media type. A reader verifying many
    records of one store passes a `MessageDigestCache` and a `RequestValueCache`, so a session's
    history and tool definitions are encoded once.
    """
    key = record.staging_key
    ex = extras_digest(record.extras)
    if ex != record.extras_digest:
        raise DigestMismatch(key, "extras_digest", record.extras_digest, ex)
    have = {a.sha256: a for a in record.attachments}
    refs = list(dict.fromkeys(record.attachment_refs()))
    if record.digest_version >= 2:
        # Version 2 binds each attachment's media type: without the attachment there is no
        # digest to compare, so the missing bytes are what to report.
        _check_present(key, refs, have)
    d = record_digest(record, extras_hex=ex, digester=digester, encoder=encoder)
    if d != record.digest:
        raise DigestMismatch(key, "digest", record.digest, d)
    _check_present(key, refs, have)
    for ref in refs:
        actual = hashlib.sha256(have[ref].data).hexdigest()
        if actual != ref:
            raise DigestMismatch(key, f"attachment {ref}", ref, actual)


def _check_present(key: str, refs: list[str], have: Mapping[str, Attachment]) -> None:
    for ref in refs:
        if ref not in have:
            raise DigestMismatch(key, f"attachment {ref}", ref, "missing")
