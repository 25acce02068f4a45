"""The staged-call record and the values that travel with it.

A `StagedCallRecord` is the unit a trainer learns from: one model call, with the exact token ids the
model saw and produced, the logprobs it produced them with, and everything needed to know which
policy produced them. Records validate on construction, so a bad value is refused before any sink
sees it, with an error naming the field (and the position, for token data).

Token data is held in `array.array` buffers (int32 ids, float32 logprobs), not lists of Python
ints: a 16k-token prompt is one 64 KiB buffer, which digests, stores and compares without a
per-token object.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .fields import (
    LOGPROBS_MODE_UNKNOWN,
    V2_DEFAULTS,
    BridgeSpan,
    RecordValidationError,
    WeightSpan,
    check_spans,
)
from .outcome import RolloutOutcome
from .version import DIGEST_VERSION_OF_SCHEMA, RECORD_SCHEMA_VERSION

__all__ = [
    "ID_PATTERN",
    "LOGPROBS_MODE_UNKNOWN",
    "V2_DEFAULTS",
    "Attachment",
    "BridgeSpan",
    "CallStatus",
    "CallSummary",
    "CommitCoords",
    "LedgerEntry",
    "RecordValidationError",
    "RolloutInfo",
    "RolloutState",
    "StageResult",
    "StagedCallRecord",
    "WeightSpan",
    "as_logprobs",
    "as_token_ids",
    "check_id",
]

#: Rollout ids, call ids and staging keys: 1-128 characters of ``[A-Za-z0-9._:-]``.
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class CallStatus(StrEnum):
    """What happened to one call. Used in the manifest, metrics, the ledger and `inspect`."""

    STAGED = "staged"
    #: The client was answered, but the record was not staged: the rollout is poisoned.
    CAPTURE_FAILED = "capture_failed"
    #: Refused (4xx) before anything was forwarded upstream.
    REJECTED = "rejected"
    #: The upstream answered with an error, or broke, or timed out.
    UPSTREAM_ERROR = "upstream_error"
    #: The client went away before the call finished.
    ABORTED = "aborted"


class RolloutState(StrEnum):
    OPEN = "open"
    SEALED = "sealed"


def check_id(field_name: str, value: object, *, optional: bool = False) -> None:
    """Raise `RecordValidationError` unless `value` is a well-formed id (or None if optional)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or ID_PATTERN.fullmatch(value) is None:
        raise RecordValidationError(
            field_name, f"must be 1-128 characters of [A-Za-z0-9._:-], got {value!r:.80}"
        )


_HIGH_BYTE = slice(3, None, 4) if sys.byteorder == "little" else slice(0, None, 4)
_NON_NEGATIVE_HIGH_BYTES = bytes(range(128))


def _has_negative(ids: array[int]) -> bool:
    """True if any int32 is negative: its high byte has the sign bit. Runs in C, no min() loop."""
    return bool(ids.tobytes()[_HIGH_BYTE].translate(None, _NON_NEGATIVE_HIGH_BYTES))


def as_token_ids(field_name: str, values: Iterable[int] | array[int]) -> array[int]:
    """Token ids as an int32 array; raises naming the first bad position."""
    if isinstance(values, array) and values.typecode == "i":
        ids = values
    else:
        values = list(values)
        try:
            ids = array("i", values)
            # array('i') takes True as 1; a bool is not a token id (the digest encodes it apart).
            if any(v.__class__ is bool for v in values):
                raise TypeError
        except (TypeError, OverflowError) as exc:
            for i, v in enumerate(values):
                if type(v) is not int:
                    raise RecordValidationError(
                        field_name, f"token id must be an int, got {v!r:.40}", i
                    ) from exc
                if not 0 <= v < 2**31:
                    raise RecordValidationError(
                        field_name, f"token id out of range: {v}", i
                    ) from None
            raise
    if ids and _has_negative(ids):
        i = next(i for i, v in enumerate(ids) if v < 0)
        raise RecordValidationError(field_name, f"token id must be >= 0, got {ids[i]}", i)
    return ids


def as_logprobs(field_name: str, values: Iterable[float] | array[float]) -> array[float]:
    """Logprobs as a float32 array (what vLLM computes them in); finite and <= 0."""
    if isinstance(values, array) and values.typecode == "f":
        lps = values
    else:
        try:
            lps = array("f", values)
        except (TypeError, OverflowError) as exc:
            raise RecordValidationError(field_name, "not a sequence of floats") from exc
    # Fast path in C: a NaN or infinity makes the sum non-finite (1k logprobs cannot overflow
    # a double), and once all are finite max() is exact. Only a bad array pays for the loop
    # that finds the position to report.
    if not lps or (math.isfinite(sum(lps)) and max(lps) <= 0.0):
        return lps
    for i, v in enumerate(lps):
        if not math.isfinite(v):
            raise RecordValidationError(field_name, f"logprob must be finite, got {v}", i)
        if v > 0.0:
            raise RecordValidationError(field_name, f"logprob must be <= 0, got {v}", i)
    return lps


@dataclass(frozen=True, slots=True)
class Attachment:
    """Bytes that belong to a call (an image), stored in the same atomic write as its record.

    The request refers to each attachment by `sha256`; sinks store each distinct sha256 once per
    store (OpenCode re-sends the same image on every call of a session).
    """

    sha256: str
    media_type: str
    data: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes):
            raise RecordValidationError("attachments.data", "must be bytes")
        if (
            not isinstance(self.media_type, str)
            or not self.media_type
            or "/" not in self.media_type
        ):
            raise RecordValidationError(
                "attachments.media_type",
                f"must be a media type like image/png, got {self.media_type!r}",
            )
        if not isinstance(self.sha256, str) or _SHA256_HEX.fullmatch(self.sha256) is None:
            raise RecordValidationError("attachments.sha256", "must be 64 lowercase hex digits")
        # The bytes are not re-hashed here: writers build attachments with `from_bytes`, and
        # readers check them in `verify_record`, which reports a mismatch instead of raising
        # while a store is being read.

    def check(self) -> bool:
        """True when the bytes hash to `sha256`."""
        return hashlib.sha256(self.data).hexdigest() == self.sha256

    @classmethod
    def from_bytes(cls, data: bytes, media_type: str) -> Attachment:
        return cls(hashlib.sha256(data).hexdigest(), media_type, data)

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class CommitCoords:
    """Where a staged call landed, returned to the client's driver and listed in manifests."""

    store: str
    staging_key: str
    digest: str
    extras_digest: str
    #: Tokens shared with the parent call's prompt + completion (not stored again).
    prev_len: int
    #: Tokens stored for this call: new prompt tokens plus completion tokens.
    delta_len: int
    #: prev_len + delta_len: the call's prompt + completion length.
    cum_len: int
    weight_version: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "staging_key": self.staging_key,
            "digest": self.digest,
            "extras_digest": self.extras_digest,
            "prev_len": self.prev_len,
            "delta_len": self.delta_len,
            "cum_len": self.cum_len,
            "weight_version": self.weight_version,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CommitCoords:
        return cls(**{k: d[k] for k in cls.__slots__})


@dataclass(frozen=True, slots=True)
class StageResult:
    """The outcome of `StagingSink.stage`: `staged` with coordinates, or `capture_failed`."""

    status: CallStatus
    coords: CommitCoords | None = None
    reason: str | None = None
    message: str | None = None

    @classmethod
    def staged(cls, coords: CommitCoords) -> StageResult:
        return cls(CallStatus.STAGED, coords)

    @classmethod
    def failed(cls, reason: str, message: str) -> StageResult:
        return cls(CallStatus.CAPTURE_FAILED, None, reason, message)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """A call of a rollout that was not staged, and why. Kept in the store beside the records."""

    rollout_id: str
    call_id: str
    seq: int
    status: CallStatus
    reason: str
    message: str
    http_status: int | None = None
    at_ms: int = 0

    def __post_init__(self) -> None:
        check_id("rollout_id", self.rollout_id)
        check_id("call_id", self.call_id)
        if self.status is CallStatus.STAGED:
            raise RecordValidationError(
                "status", "a ledger entry records a call that was not staged"
            )


@dataclass(frozen=True, slots=True)
class RolloutInfo:
    """A rollout's ledger header: its state, whether any call failed capture, and its outcomes."""

    rollout_id: str
    state: RolloutState
    poisoned: bool
    created_at_ms: int
    sealed_at_ms: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    policy: Mapping[str, Any] = field(default_factory=dict)
    #: Every outcome the driver sent (``PUT /admin/rollouts/{id}/outcome``), oldest first.
    outcome_history: tuple[RolloutOutcome, ...] = ()

    @property
    def outcome(self) -> RolloutOutcome | None:
        """The rollout's outcome: the last one sent (None before any)."""
        return self.outcome_history[-1] if self.outcome_history else None


@dataclass(frozen=True, slots=True, eq=False)
class StagedCallRecord:
    """One model call, exactly as the model saw and produced it.

    Construct it with token ids and logprobs as lists or arrays; they are converted to
    ``array('i')`` / ``array('f')`` and validated (ids >= 0, logprobs finite and <= 0, one logprob
    per completion token). `digest` and `extras_digest` are computed by
    `capture_proxy.schemas.digest.seal_record`, which returns a copy with both filled.

    `request` is the normalized request as forwarded upstream, with each image's bytes replaced by
    a reference to its attachment (``"url": "attachment:sha256:<hex>"``); `response` is the
    assistant message (``role``, ``content``, ``reasoning_content``, ``tool_calls``).
    `attachments` is filled on records read back from a store; writers pass attachments to
    `StagingSink.stage` separately.

    Versions: `weight_version` is the driver's version at admission; `engine_weight_version` is
    the engine's own when it reports one (vLLM's ``/weight_info``), and `weight_spans` says which
    engine version sampled which completion tokens (``[]``: unknown). Also recorded: whether the
    call went token-in (`token_in`) and which prompt tokens the proxy inserted (`bridge_spans`),
    the upstream replica (`replica`, ``""`` for a single upstream), the sampling parameters the
    engine applied after its own defaults (`effective_sampling`, None when unknown), and the
    engine's logprobs mode (`logprobs_mode`: ``raw_logprobs``, ``processed_logprobs``, ... or
    ``"unknown"``). These came with record schema 2 (`schema_version`); a version-1 record read
    from an older store holds their defaults.
    """

    rollout_id: str
    call_id: str
    seq: int
    model: str
    finish_reason: str
    request: Mapping[str, Any]
    response: Mapping[str, Any]
    prompt_token_ids: array[int]
    completion_token_ids: array[int]
    completion_logprobs: array[float]
    parent_call_id: str | None = None
    retry_of: str | None = None
    created_at_ms: int = 0
    weight_version: int = 0
    upstream_version: str = ""
    tokenizer_fingerprint: str = ""
    sampling: Mapping[str, Any] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)
    engine_weight_version: str | None = None
    weight_spans: Sequence[WeightSpan] = ()
    token_in: bool = False
    bridge_spans: Sequence[BridgeSpan] = ()
    replica: str = ""
    effective_sampling: Mapping[str, Any] | None = None
    logprobs_mode: str = LOGPROBS_MODE_UNKNOWN
    status: CallStatus = CallStatus.STAGED
    schema_version: int = RECORD_SCHEMA_VERSION
    digest: str = ""
    extras_digest: str = ""
    attachments: tuple[Attachment, ...] = ()

    def __post_init__(self) -> None:
        check_id("rollout_id", self.rollout_id)
        check_id("call_id", self.call_id)
        check_id("parent_call_id", self.parent_call_id, optional=True)
        check_id("retry_of", self.retry_of, optional=True)
        for name in ("seq", "created_at_ms", "weight_version", "schema_version"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise RecordValidationError(name, f"must be a non-negative int, got {v!r}")
        for name in ("model", "finish_reason"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise RecordValidationError(name, f"must be a non-empty string, got {v!r}")
        for name in ("upstream_version", "tokenizer_fingerprint", "digest", "extras_digest"):
            if not isinstance(getattr(self, name), str):
                raise RecordValidationError(name, "must be a string")
        for name in ("request", "response", "sampling", "extras"):
            if not isinstance(getattr(self, name), Mapping):
                raise RecordValidationError(name, "must be a mapping")
        if self.schema_version > RECORD_SCHEMA_VERSION:
            raise RecordValidationError(
                "schema_version",
                f"record format {self.schema_version} is newer than this capture-proxy "
                f"understands ({RECORD_SCHEMA_VERSION}): upgrade capture-proxy",
            )
        if self.schema_version not in DIGEST_VERSION_OF_SCHEMA:
            raise RecordValidationError(
                "schema_version",
                f"must be one of {sorted(DIGEST_VERSION_OF_SCHEMA)}, got {self.schema_version}",
            )
        # frozen dataclass: object.__setattr__ is the sanctioned way to normalize in __post_init__.
        object.__setattr__(self, "status", CallStatus(self.status))
        prompt = as_token_ids("prompt_token_ids", self.prompt_token_ids)
        completion = as_token_ids("completion_token_ids", self.completion_token_ids)
        logprobs = as_logprobs("completion_logprobs", self.completion_logprobs)
        if not prompt:
            raise RecordValidationError("prompt_token_ids", "must not be empty")
        if len(logprobs) != len(completion):
            raise RecordValidationError(
                "completion_logprobs",
                f"one logprob per completion token: {len(logprobs)} logprobs for "
                f"{len(completion)} tokens",
            )
        object.__setattr__(self, "prompt_token_ids", prompt)
        object.__setattr__(self, "completion_token_ids", completion)
        object.__setattr__(self, "completion_logprobs", logprobs)
        object.__setattr__(self, "attachments", tuple(self.attachments))
        self._check_v2_fields(len(prompt), len(completion))

    def _check_v2_fields(self, prompt_len: int, completion_len: int) -> None:
        ewv = self.engine_weight_version
        if ewv is not None and (not isinstance(ewv, str) or not ewv):
            raise RecordValidationError(
                "engine_weight_version", f"must be a non-empty string or None, got {ewv!r:.80}"
            )
        weight_spans = check_spans(
            "weight_spans", self.weight_spans, completion_len, 0, "completion tokens"
        )
        bridge_spans = check_spans(
            "bridge_spans", self.bridge_spans, prompt_len, 2, "prompt tokens"
        )
        object.__setattr__(self, "weight_spans", weight_spans)
        object.__setattr__(self, "bridge_spans", bridge_spans)
        if type(self.token_in) is not bool:
            raise RecordValidationError("token_in", f"must be true or false, got {self.token_in!r}")
        if not isinstance(self.replica, str):
            raise RecordValidationError("replica", f"must be a string, got {self.replica!r:.80}")
        if self.effective_sampling is not None and not isinstance(self.effective_sampling, Mapping):
            raise RecordValidationError(
                "effective_sampling", "must be a mapping, or None when unknown"
            )
        if not isinstance(self.logprobs_mode, str) or not self.logprobs_mode:
            raise RecordValidationError(
                "logprobs_mode",
                f'must be a non-empty string ("unknown" allowed), got {self.logprobs_mode!r:.80}',
            )
        if self.schema_version < 2:
            # A version-1 digest does not cover these fields: a value there would be unsealed.
            for name, default in V2_DEFAULTS.items():
                if getattr(self, name) != default:
                    raise RecordValidationError(
                        name, "needs record schema_version 2 (a version-1 record cannot hold it)"
                    )

    @property
    def digest_version(self) -> int:
        """The digest encoding this record is sealed and verified with (docs/digest.md)."""
        return DIGEST_VERSION_OF_SCHEMA[self.schema_version]

    @property
    def staging_key(self) -> str:
        """The key this record is stored and fetched under (its call id: globally unique)."""
        return self.call_id

    @property
    def cum_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.completion_token_ids)

    def attachment_refs(self) -> list[str]:
        """The sha256 of every attachment the request refers to, in order of appearance."""
        from .attachments import iter_attachment_refs

        return list(iter_attachment_refs(self.request))

    def logical_equal(self, other: StagedCallRecord) -> bool:
        """True when both records hold the same logical content (what the digest covers)."""
        return (
            self.digest == other.digest
            and self.extras_digest == other.extras_digest
            and bool(self.digest)
        )


@dataclass(frozen=True, slots=True)
class CallSummary:
    """The scalar facts of one staged call, read without decoding its tokens or messages.

    What `StagingSource.summaries` returns: enough for listings (token counts, lineage, times)
    at the cost of a few columns per call. ``prompt_len + completion_len == cum_len``; `prev_len`
    is how many of those tokens the call shares with its parent (stored once, with the parent).
    """

    call_id: str
    seq: int
    parent_call_id: str | None
    retry_of: str | None
    finish_reason: str
    prompt_len: int
    completion_len: int
    cum_len: int
    prev_len: int
    created_at_ms: int
    weight_version: int
    #: The write landed after its caller gave up (`StagingSink.mark_orphaned`).
    orphaned: bool
