"""The storage encoding shared by the SQLite and Parquet sinks: one logical record <-> one row.

Storage is linear in a session (docs/storage.md):

* Tokens: a call stores only ``full[prev_len:]``, where ``full`` is its prompt + completion and
  ``prev_len`` the longest common prefix with its parent's prompt + completion. A call that drifted
  (its prompt does not extend the parent's sequence) still stores only what follows the common
  prefix. Reading rebuilds ``full`` as ``parent_full[:prev_len] + delta``.
* Messages: each message is a content-addressed blob (key: sha256 of its stored bytes); a call
  stores the list of its messages' keys, so the history re-sent with every turn is stored once.
  The rest of the request (tools, sampling, ...) is one blob too: OpenCode sends the same 10 KB of
  tool definitions with every call.
* Logprobs: float32, completion tokens only.

The digest is over the logical record, so it is independent of all of this; `decode_row` rebuilds
the logical record and `verify_record` proves the round trip.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..schemas.message_memo import MessageMemo
from ..schemas.records import Attachment, StagedCallRecord
from ..schemas.tokens import common_prefix_len, full_sequence

__all__ = [
    "ROW_FIELDS",
    "V2_ROW_FIELDS",
    "EncodedCall",
    "bind_media_types",
    "decode_row",
    "encode_record",
    "reference_media_types",
    "stored_bytes",
    "stored_int",
]

_LITTLE = sys.byteorder == "little"

#: The columns added with record schema 2 (SQLite format 4; nullable in Parquet). A row written
#: before them has none of them (or NULLs), and reads back as a version-1 record with defaults.
#: `weight_spans`, `bridge_spans` and `effective_sampling` are JSON bytes (NULL: the default).
V2_ROW_FIELDS = (
    "engine_weight_version",
    "weight_spans",
    "token_in",
    "bridge_spans",
    "replica",
    "effective_sampling",
    "logprobs_mode",
)

#: The scalar columns of a stored call, in a stable order (both sinks use these names).
ROW_FIELDS = (
    "call_id",
    "rollout_id",
    "seq",
    "parent_call_id",
    "retry_of",
    "created_at_ms",
    "weight_version",
    "model",
    "upstream_version",
    "tokenizer_fingerprint",
    "finish_reason",
    "schema_version",
    "sampling",
    "response",
    "extras",
    "request_key",
    "message_keys",
    "prompt_len",
    "prev_len",
    "delta_len",
    "cum_len",
    "delta_tokens",
    "completion_logprobs",
    "digest",
    "extras_digest",
    "attachment_shas",
    # The media type of each reference in `attachment_shas` (same order; a None item: not
    # known when staged, the stored bytes' own media type stands). Added after record schema
    # 2: a row written before has none (NULL), and every reference reads with its bytes'.
    "attachment_media_types",
    *V2_ROW_FIELDS,
)


def _le(values: array[Any]) -> bytes:
    if _LITTLE:
        return values.tobytes()
    c = array(values.typecode, values)
    c.byteswap()
    return c.tobytes()


def _from_le(typecode: str, data: bytes) -> array[Any]:
    a = array(typecode)
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a


def _dumps(value: Any) -> bytes:
    # Keys keep the client's order: chat templates render tool schemas (and anything else) in
    # the order they were sent, so a trainer re-rendering `record.request` must get the same
    # bytes the upstream saw. A client re-sends its history unchanged, so content addressing
    # still stores each message once; the digest sorts keys itself (schemas/digest.py).
    return orjson.dumps(value)


def blob_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: Each rollout's message blobs named once, not once per call: a session re-sends its history
#: with every call (schemas/message_memo.py). A blob's key is a pure function of its bytes, so
#: one memo serves every sink in the process.
MESSAGE_KEYS: MessageMemo[str] = MessageMemo()


@dataclass(frozen=True, slots=True)
class EncodedCall:
    """What a sink writes for one record: a row, the blobs it refers to, and its full sequence."""

    row: dict[str, Any]
    #: key -> bytes for every blob the row refers to (the sink skips keys it already has).
    blobs: dict[str, bytes]
    #: prompt + completion: cache it, it is the prefix the next call of the session extends.
    full: array[int]


def reference_media_types(
    record: StagedCallRecord, given: Mapping[str, Attachment] | None = None
) -> list[str | None]:
    """The media type of each attachment `record` refers to (in order of first reference, each
    sha256 once), as its digest was sealed with: the attachment given with it, else the one in
    ``record.attachments`` (a record read back from a store), else None (not known here).

    Kept per reference, not per stored bytes: two calls may send the same image bytes under two
    media types, and each record's digest binds its own (docs/digest.md)."""
    known = {a.sha256: a.media_type for a in record.attachments}
    for sha, att in (given or {}).items():
        if att.sha256 == sha:
            known[sha] = att.media_type
    return [known.get(sha) for sha in dict.fromkeys(record.attachment_refs())]


def bind_media_types(
    attachments: Sequence[Attachment], shas: Sequence[str] | None, types: Sequence[Any] | None
) -> tuple[Attachment, ...]:
    """`attachments` (the stored bytes, each with the media type stored with them) with each
    one's media type replaced by its reference's: ``types[i]`` is the media type of the
    reference ``shas[i]`` (None, or no `types` at all in a row written before they were kept:
    the stored media type stands)."""
    by_sha = {s: t for s, t in zip(shas or (), types or (), strict=False) if t}
    return tuple(
        Attachment(a.sha256, t, a.data)
        if (t := by_sha.get(a.sha256)) is not None and t != a.media_type
        else a
        for a in attachments
    )


def encode_record(
    record: StagedCallRecord,
    parent_full: array[int] | None,
    attachments: Mapping[str, Attachment] | None = None,
) -> EncodedCall:
    """Encode a sealed record. `parent_full` is the parent's prompt + completion, or None.

    The caller resolves the parent (`record.parent_call_id`) within the same rollout; with no
    parent the whole sequence is stored (prev_len 0). `attachments` are the ones given with the
    record (`StagingSink.stage`): they say each reference's media type
    (`reference_media_types`).
    """
    full = full_sequence(record.prompt_token_ids, record.completion_token_ids)
    prev_len = common_prefix_len(parent_full, full) if parent_full is not None else 0
    blobs: dict[str, bytes] = {}
    message_keys = bytearray()
    request = dict(record.request)
    for message in request.get("messages") or ():
        data = _dumps(message)
        key = MESSAGE_KEYS.get(record.rollout_id, data, functools.partial(blob_key, data))
        blobs[key] = data
        message_keys += bytes.fromhex(key)
    if "messages" in request:
        request["messages"] = None  # stored apart; the placeholder keeps the key's position
    rest = _dumps(request)
    request_key = blob_key(rest)
    blobs[request_key] = rest
    row: dict[str, Any] = {
        "call_id": record.call_id,
        "rollout_id": record.rollout_id,
        "seq": record.seq,
        # Kept even when the parent is not in this store (staged before a restart, or
        # elsewhere): the lineage is part of the logical record; then prev_len is 0.
        "parent_call_id": record.parent_call_id,
        "retry_of": record.retry_of,
        "created_at_ms": record.created_at_ms,
        "weight_version": record.weight_version,
        "model": record.model,
        "upstream_version": record.upstream_version,
        "tokenizer_fingerprint": record.tokenizer_fingerprint,
        "finish_reason": record.finish_reason,
        "schema_version": record.schema_version,
        "sampling": _dumps(sampling_by_reference(record.sampling, record.request)),
        "response": _dumps(record.response),
        "extras": _dumps(record.extras),
        "request_key": request_key,
        "message_keys": bytes(message_keys),
        "prompt_len": len(record.prompt_token_ids),
        "prev_len": prev_len,
        "delta_len": len(full) - prev_len,
        "cum_len": len(full),
        "delta_tokens": _le(full[prev_len:]),
        "completion_logprobs": _le(record.completion_logprobs),
        "digest": record.digest,
        "extras_digest": record.extras_digest,
        "attachment_shas": list(dict.fromkeys(record.attachment_refs())),
        "attachment_media_types": reference_media_types(record, attachments),
        "engine_weight_version": record.engine_weight_version,
        "weight_spans": _dumps(record.weight_spans) if record.weight_spans else None,
        "token_in": record.token_in,
        "bridge_spans": _dumps(record.bridge_spans) if record.bridge_spans else None,
        "replica": record.replica,
        "effective_sampling": (
            None if record.effective_sampling is None else _dumps(record.effective_sampling)
        ),
        "logprobs_mode": record.logprobs_mode,
    }
    return EncodedCall(row, blobs, full)


def stored_bytes(value: object, what: str) -> bytes:
    """A binary column's value as a reader takes it: bytes (a crafted store may hold a number
    there, which ``bytes()`` would turn into that many zero bytes)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} is {type(value).__name__}, not bytes")


def stored_int(value: object, what: str) -> int:
    """An integer column's value as a reader takes it: an int, not a float, text or bytes."""
    if type(value) is not int:
        raise TypeError(f"{what} is {type(value).__name__} {value!r:.40}, not an integer")
    return value


def _v2_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    """The schema-2 fields of a row; a missing column or NULL is the field's default."""
    out: dict[str, Any] = {}
    for name in V2_ROW_FIELDS:
        value = row.get(name)
        if value is None:
            continue
        if name in ("weight_spans", "bridge_spans", "effective_sampling"):
            value = orjson.loads(stored_bytes(value, name))
        elif name == "token_in":
            value = bool(value)  # SQLite has no booleans: 0/1
        out[name] = value
    return out


def decode_row(
    row: Mapping[str, Any],
    blob: Callable[[str], bytes],
    parent_full: array[int] | None,
    attachments: Sequence[Attachment] = (),
) -> tuple[StagedCallRecord, array[int]]:
    """Rebuild the logical record from a row; returns it with its full sequence.

    `blob(key)` returns a stored blob (KeyError if missing). `parent_full` must be the parent's
    full sequence when ``row["prev_len"] > 0``. `attachments` are the stored bytes the row
    refers to; a row that holds ``attachment_media_types`` gives each its reference's media type
    (`bind_media_types`), a row without (SQLite keeps them with the references) keeps theirs.
    """
    prev_len = stored_int(row["prev_len"], "prev_len")
    delta = _from_le("i", stored_bytes(row["delta_tokens"], "delta_tokens"))
    if prev_len:
        if parent_full is None or len(parent_full) < prev_len:
            raise ValueError(
                f"{row['call_id']}: needs {prev_len} tokens of parent {row['parent_call_id']}"
            )
        full = parent_full[:prev_len]
        full.extend(delta)
    else:
        full = delta
    prompt_len = stored_int(row["prompt_len"], "prompt_len")
    if len(full) != stored_int(row["cum_len"], "cum_len") or prompt_len > len(full):
        raise ValueError(
            f"{row['call_id']}: stored lengths disagree (prompt {prompt_len}, "
            f"cum {row['cum_len']}, rebuilt {len(full)})"
        )
    keys = stored_bytes(row["message_keys"], "message_keys")
    try:
        messages = [orjson.loads(blob(keys[i : i + 32].hex())) for i in range(0, len(keys), 32)]
        request = orjson.loads(blob(str(row["request_key"])))
    except KeyError as e:
        # A missing blob is damage, not an unknown key: say so, so no caller reads it as
        # "no such call" (KeyError is what fetch() raises for keys that were never staged).
        raise ValueError(
            f"{row['call_id']}: a stored blob is missing ({e}): the store is damaged"
        ) from e
    request["messages"] = messages
    record = StagedCallRecord(
        rollout_id=row["rollout_id"],
        call_id=row["call_id"],
        seq=int(row["seq"]),
        model=row["model"],
        finish_reason=row["finish_reason"],
        request=request,
        response=orjson.loads(row["response"]),
        prompt_token_ids=full[:prompt_len],
        completion_token_ids=full[prompt_len:],
        completion_logprobs=_from_le(
            "f", stored_bytes(row["completion_logprobs"], "completion_logprobs")
        ),
        parent_call_id=row["parent_call_id"],
        retry_of=row["retry_of"],
        created_at_ms=int(row["created_at_ms"]),
        weight_version=int(row["weight_version"]),
        upstream_version=row["upstream_version"],
        tokenizer_fingerprint=row["tokenizer_fingerprint"],
        sampling=sampling_from_reference(orjson.loads(row["sampling"]), request),
        extras=orjson.loads(row["extras"]),
        schema_version=int(row["schema_version"]),
        digest=row["digest"],
        extras_digest=row["extras_digest"],
        attachments=bind_media_types(
            attachments, row.get("attachment_shas"), row.get("attachment_media_types")
        ),
        **_v2_fields(row),
    )
    return record, full


#: In a stored `sampling`: the keys whose values are the request's own (stored once, there).
SAME_AS_REQUEST = "$same_as_request"


def sampling_by_reference(sampling: Mapping[str, Any], request: Mapping[str, Any]) -> Any:
    """`sampling` as stored: a free-form value (an object or a list, e.g. a large
    ``chat_template_kwargs``) equal to the request's own is named, not repeated: the request
    blob holds it once. Sampling keys never start with ``$``, so the marker cannot collide. The
    digest is over the logical record, which this does not change."""
    same = [
        k
        for k, v in sampling.items()
        if isinstance(v, dict | list) and k in request and request[k] == v
    ]
    if not same:
        return sampling
    kept = {k: v for k, v in sampling.items() if k not in same}
    return {**kept, SAME_AS_REQUEST: same}


def sampling_from_reference(stored: Any, request: Mapping[str, Any]) -> dict[str, Any]:
    """The logical `sampling` back from its stored form (rows written before stored it whole)."""
    if not isinstance(stored, dict) or SAME_AS_REQUEST not in stored:
        return dict(stored) if isinstance(stored, dict) else stored
    same = stored.pop(SAME_AS_REQUEST)
    for key in same:
        stored[key] = request[key]  # the digest sorts keys: their order here does not matter
    return stored
