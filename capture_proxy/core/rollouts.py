"""Live per-rollout state: sequence numbers, lineage candidates, retries, in-flight calls, outcomes.

This is what the proxy must remember between the calls of one rollout to record them right: the
next sequence number, which earlier call a new call continues (its parent), whether a call
repeats an earlier request (a retry), and what happened to every call so far (the manifest).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..schemas.events import EventKind, RolloutEvent, token_in_choice
from ..schemas.fields import RecordValidationError
from ..schemas.outcome import RolloutOutcome
from ..schemas.records import (
    Attachment,
    CallStatus,
    CommitCoords,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from ..schemas.token_in_extras import media_of
from ..schemas.tokens import full_sequence
from ..sinks.base import ReadsInSnapshots, StagingSource
from .experts import ExpertsIndex, stored_entry
from .lineage import LineageIndex
from .token_in import Prior, token_in_line
from .weights import DECREASED_FROM

log = logging.getLogger("capture_proxy.rollouts")

#: A claimed call with neither a record nor a ledger entry (the manifest's status for it).
LOST_IN_CRASH = "lost_in_crash"
#: Where a keyed rollout's key hash is kept in its stored metadata.
KEY_HASH_FIELD = "capture_proxy_key_sha256"

__all__ = [
    "KEY_HASH_FIELD",
    "LOST_IN_CRASH",
    "CallOutcome",
    "RolloutLive",
    "pinned_replica",
    "prior_of",
    "record_bytes",
    "request_key",
    "resume_rollout",
]

#: How many lines of token-in calls a rollout keeps the last call of (`token_in_priors`).
TOKEN_IN_LINES = 4
#: How many request keys per rollout are kept for retry detection (a retry repeats a recent call).
REQUESTS_KEPT = 128
#: Records decoded at a time when a resumed rollout's staged bytes are counted.
_USAGE_BATCH = 64


@dataclass(slots=True)
class CallOutcome:
    """One line of the manifest."""

    seq: int
    call_id: str
    status: str  # a CallStatus value, or "pending" while in flight
    coords: CommitCoords | None = None
    reason: str | None = None
    http_status: int | None = None
    message: str | None = None
    retry_of: str | None = None
    #: Stamped with a lower weight version than the rollout's previous call: that call's version.
    weight_version_decreased_from: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"seq": self.seq, "call_id": self.call_id, "status": self.status}
        if self.retry_of:
            d["retry_of"] = self.retry_of
        if self.weight_version_decreased_from is not None:
            d["weight_version_decreased_from"] = self.weight_version_decreased_from
        if self.coords is not None:
            d["coords"] = self.coords.to_dict()
        if self.status not in (CallStatus.STAGED, "pending"):
            d.update(reason=self.reason, http_status=self.http_status, message=self.message)
        return d


@dataclass(slots=True)
class RolloutLive:
    rollout_id: str
    next_seq: int = 0
    sealed: bool = False
    #: When the seal was written to the store (None before): the header says sealed only then,
    #: not while the seal still waits for calls in flight.
    sealed_at_ms: int | None = None
    poisoned: bool = False
    created_at_ms: int = 0
    #: Every outcome the driver sent, oldest first (`RolloutInfo.outcome_history`).
    outcome_history: tuple[RolloutOutcome, ...] = ()
    #: sha256 of the rollout's API key, when keys are required. Only the hash is kept, in memory
    #: and in the store (rollout metadata), so a sandbox keeps its key across a proxy restart.
    key_sha256: str | None = None
    policy: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Whether the rollout's calls go token-in, as chosen when it was created (its ``token_in``
    #: event); None: the proxy's ``--token-in`` setting decides.
    token_in: bool | None = None
    in_flight: int = 0
    #: time.monotonic() of the last admitted call: idle rollouts leave memory (resumed if seen).
    last_active: float = 0.0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: Every staged call of the rollout, for the parent search (`LineageIndex`).
    lineage: LineageIndex = field(default_factory=LineageIndex)
    #: The staged calls that hold routed experts, by their messages: where a new call's experts
    #: may start (`capture_proxy.core.experts`).
    experts: ExpertsIndex = field(default_factory=ExpertsIndex)
    # request_key -> call ids with that exact normalized request (oldest first)
    requests: OrderedDict[bytes, str] = field(default_factory=OrderedDict)
    outcomes: dict[str, CallOutcome] = field(default_factory=dict)
    #: Quota usage (``--max-rollout-calls``, ``--max-rollout-bytes``): calls admitted (refusals
    #: not counted), `record_bytes` of every record staged, and the bodies of calls in flight
    #: (reserved at admission, so concurrent calls cannot all slip under the quota at once).
    calls_used: int = 0
    #: Refused calls written to the ledger: bounded by ``--max-rollout-calls`` as well, so a
    #: sandbox sending bodies the proxy refuses cannot write ledger rows without end.
    refusals: int = 0
    bytes_staged: int = 0
    bytes_reserved: int = 0
    #: The weight version the rollout's last admitted call was stamped with (None: no call yet),
    #: so a lower one is flagged; resumed from the last staged record.
    last_weight_version: int | None = None
    #: The upstream replica the rollout is pinned to ("" for a single upstream, or none chosen
    #: yet); resumed from its last ``replica`` event.
    replica: str = ""
    #: The last staged token-in call of each line of calls (`token_in_line`: the same tools,
    #: template keys and system message; OpenCode's title call is a line of its own), by line,
    #: with its seq: what the next token-in call continues. At most `TOKEN_IN_LINES` lines, one
    #: call's request, answer and ids each, whatever the rollout's length; resumed from the
    #: store's token-in records.
    token_in_priors: OrderedDict[str, tuple[int, Prior]] = field(default_factory=OrderedDict)

    def remember_token_in(self, seq: int, line: str, prior: Prior) -> None:
        """Keep `prior` (call `seq`) as the call its `line`'s next token-in call continues,
        unless a later call of the line (staged first by concurrent calls) is kept already."""
        kept = self.token_in_priors.get(line)
        if kept is not None and kept[0] > seq:
            return
        self.token_in_priors[line] = (seq, prior)
        self.token_in_priors.move_to_end(line)
        while len(self.token_in_priors) > TOKEN_IN_LINES:
            self.token_in_priors.popitem(last=False)

    def token_in_prior(self, line: str) -> Prior | None:
        """The call a token-in call of `line` continues: that line's last staged call, else the
        rollout's last (the bridge then says why the call does not continue it), else None."""
        kept = self.token_in_priors.get(line)
        if kept is None and self.token_in_priors:
            kept = max(self.token_in_priors.values(), key=lambda entry: entry[0])
        return kept[1] if kept is not None else None

    def __post_init__(self) -> None:
        self.idle.set()

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def enter(self) -> None:
        self.in_flight += 1
        self.last_active = time.monotonic()
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self.idle.set()

    def retry_of(self, request_key: bytes) -> str | None:
        """The latest earlier call with exactly this normalized request, if any."""
        return self.requests.get(request_key)

    def remember_request(self, request_key: bytes, call_id: str) -> None:
        self.requests[request_key] = call_id
        self.requests.move_to_end(request_key)
        while len(self.requests) > REQUESTS_KEPT:
            self.requests.popitem(last=False)

    def choose_parent(self, prompt: array[int], request_key: bytes) -> str | None:
        """The staged call whose prompt + completion shares the longest prefix with `prompt`.

        Ties go to the latest call. Earlier attempts of the same request (retries) are not
        candidates: a retry is their sibling, not their continuation. Every staged call of the
        rollout is a candidate (`LineageIndex`), however long ago it was staged.
        """
        return self.lineage.choose(prompt, request_key)

    def add_lineage(self, seq: int, call_id: str, full: array[int], request_key: bytes) -> None:
        self.lineage.add(seq, call_id, full, request_key)


def prior_of(record: StagedCallRecord) -> Prior:
    """A staged record as the token-in bridge continues it (`Prior`): its images' placeholders
    are the ones its extras keep (`media_of`); a value of the wrong shape is logged and kept as
    none, so the next call with images in its history starts a new segment instead of failing."""
    try:
        media = media_of(record.extras)
    except RecordValidationError as e:
        log.warning(
            "token-in record %s keeps unreadable image placeholders: %s",
            record.call_id,
            e,
            extra={"rollout_id": record.rollout_id, "call_id": record.call_id},
        )
        media = None
    return Prior(
        request=record.request,
        message=record.response,
        prompt_ids=record.prompt_token_ids,
        completion_ids=record.completion_token_ids,
        finish_reason=record.finish_reason,
        media=media,
        stored=True,
        fingerprint=record.tokenizer_fingerprint,
        stop_reason=_stop_reason(record.extras.get("stop_reason")),
    )


def _stop_reason(value: object) -> int | str | None:
    """A record's ``stop_reason`` extra as generate gave it (None when absent or malformed)."""
    return value if type(value) in (int, str) else None  # type: ignore[return-value]


def record_bytes(
    record: StagedCallRecord,
    attachments: Iterable[Attachment] = (),
    *,
    request_size: int | None = None,
) -> int:
    """What a staged call counts against its rollout's byte quota: its request, answer and
    extras as JSON, 4 bytes per token id and logprob, and its images' bytes (`attachments`, or the
    record's own when read back). `sampling` is not counted: it repeats values of the request.
    `request_size` is the request's JSON size when already known (`request_identity`).

    A logical size, the same whether computed when staging or from the store after a restart,
    and independent of how a sink compresses or shares what it stores.
    """
    if request_size is None:
        request_size = len(orjson.dumps(record.request))
    size = request_size + len(orjson.dumps(record.response)) + len(orjson.dumps(record.extras))
    tokens = len(record.prompt_token_ids) + len(record.completion_token_ids)
    size += 4 * (tokens + len(record.completion_logprobs))
    images = tuple(attachments) or record.attachments
    return size + sum(len(a.data) for a in images)


def request_key(request: Mapping[str, Any]) -> bytes:
    """Identity of a normalized request (retry detection): sha256 of its sorted-key JSON."""
    return request_identity(request)[0]


def request_identity(request: Mapping[str, Any]) -> tuple[bytes, int]:
    """`request_key` and the request's JSON size (what `record_bytes` counts for it), from one
    encoding: sorting the keys changes their order, never the length."""
    encoded = orjson.dumps(request, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(encoded).digest(), len(encoded)


def resume_rollout(
    open_source: Callable[[], StagingSource],
    rollout_id: str,
    in_flight: Collection[str] = frozenset(),
) -> RolloutLive | None:
    """The rollout as the store has it (None if the store does not know it). Blocking I/O.

    `in_flight`: ids of this process's calls of the rollout still running (a rollout read
    again while held, `core/handback.py`): their claims are theirs, not ``lost_in_crash``.

    Reads the per-call summaries, ledger and admission claims for sequence numbers and the
    manifest (a claim with no record nor ledger entry is ``lost_in_crash`` and poisons the
    rollout; the next seq follows the highest claimed one), then decodes the staged records in
    batches, once: for the quota's byte count, the parent search's index, the retry candidates
    and the calls routed experts may continue. O(rollout) per resume, on a worker thread. A
    source that can (`ReadsInSnapshots`) reads the rollout as of one listing of the store, not
    one per read.
    """
    source = open_source()
    if isinstance(source, ReadsInSnapshots):
        with source.snapshot():
            return _resume(source, rollout_id, in_flight)
    return _resume(source, rollout_id, in_flight)


def _resume(
    source: StagingSource, rollout_id: str, in_flight: Collection[str]
) -> RolloutLive | None:
    claims: dict[int, str] | None = None
    try:
        info = source.rollout_info(rollout_id)
    except KeyError:
        # No header, but maybe claims: the rollout's first calls were admitted (claimed) and
        # their proxy stopped before the unit holding its header committed. Their seqs are
        # taken all the same: the rollout exists, and continues after them.
        claims = source.claims(rollout_id)
        if not claims:
            return None
        info = RolloutInfo(rollout_id, RolloutState.OPEN, False, int(time.time() * 1000))
    summaries = source.summaries(rollout_id)
    keys = [s.call_id for s in summaries]
    coords = source.coords(keys)
    failures = source.failures(rollout_id)
    events = source.events(rollout_id)
    live = RolloutLive(
        rollout_id,
        sealed=info.state is RolloutState.SEALED,
        sealed_at_ms=info.sealed_at_ms if info.state is RolloutState.SEALED else None,
        poisoned=info.poisoned,
        created_at_ms=info.created_at_ms,
        outcome_history=info.outcome_history,
        policy=dict(info.policy),
        metadata={k: v for k, v in info.metadata.items() if k != KEY_HASH_FIELD},
        key_sha256=info.metadata.get(KEY_HASH_FIELD),
        token_in=token_in_choice(events),
        replica=pinned_replica(events),
    )
    for summary, c in zip(summaries, coords, strict=True):
        live.outcomes[summary.call_id] = CallOutcome(
            summary.seq, summary.call_id, CallStatus.STAGED, coords=c, retry_of=summary.retry_of
        )
    for f in failures:
        live.outcomes[f.call_id] = CallOutcome(
            f.seq,
            f.call_id,
            f.status,
            reason=f.reason,
            http_status=f.http_status,
            message=f.message,
        )
    # Every claimed seq is taken, even one whose call never ended (a crash): a rollout
    # continued here, by this proxy after a restart or by another one, never reuses a seq.
    if claims is None:
        claims = source.claims(rollout_id)
    lost = {
        seq: cid for seq, cid in claims.items() if cid not in live.outcomes and cid not in in_flight
    }
    for seq, call_id in lost.items():
        live.outcomes[call_id] = CallOutcome(
            seq,
            call_id,
            LOST_IN_CRASH,
            reason=LOST_IN_CRASH,
            message="admitted (claimed), then neither staged nor in the ledger: the proxy "
            "stopped while the call was in flight",
        )
    if lost:
        live.poisoned = True
    live.next_seq = 1 + max(
        max((o.seq for o in live.outcomes.values()), default=-1), max(claims, default=-1)
    )
    # Quota usage is derived from what the rollout staged, never reset by a restart. Counting
    # the bytes decodes every record (in batches, on this worker thread): O(rollout) per resume;
    # the same pass rebuilds the parent search's index (orphaned records are no parents).
    live.calls_used = (
        len(summaries) + sum(1 for f in failures if f.status != CallStatus.REJECTED) + len(lost)
    )
    live.refusals = sum(1 for f in failures if f.status == CallStatus.REJECTED)
    orphaned = {s.call_id for s in summaries if s.orphaned}
    for start in range(0, len(keys), _USAGE_BATCH):
        batch = source.fetch(keys[start : start + _USAGE_BATCH])
        live.bytes_staged += sum(record_bytes(r) for r in batch)
        for r in batch:
            if r.call_id not in orphaned:
                key = request_key(r.request)
                live.remember_request(key, r.call_id)
                full = full_sequence(r.prompt_token_ids, r.completion_token_ids)
                live.add_lineage(r.seq, r.call_id, full, key)
                entry = stored_entry(r.request, r.response, full, r.extras, r.seq, r.call_id)
                if entry is not None:
                    live.experts.add(*entry)
                if r.token_in:
                    live.remember_token_in(r.seq, token_in_line(r.request), prior_of(r))
            # The flag a record carries shows in its manifest line again.
            decreased = r.extras.get(DECREASED_FROM)
            if isinstance(decreased, int):
                live.outcomes[r.call_id].weight_version_decreased_from = decreased
    if summaries:
        live.last_weight_version = summaries[-1].weight_version
    return live


def pinned_replica(events: Sequence[RolloutEvent]) -> str:
    """The replica a rollout is pinned to as its event log has it (the latest ``replica``
    event), "" when it has none."""
    for event in reversed(events):
        if event.kind == EventKind.REPLICA:
            return str(event.body.get("replica", ""))
    return ""
