"""The capture core: everything that turns one model call into a staged record, without HTTP.

`Capture` admits calls (sequence numbers, retries, weight version), builds and seals their
records, stages them through the `Stager` and keeps the ledger of calls that were not staged. The
flow of one call around it (decode, upstream, relay) is `capture_proxy.core.exchange.Exchange`;
every outcome is reported once to the `Capture.on_outcome` subscribers (the proxy's metrics).

Policy written into the code: a call is either staged exactly, or recorded in its rollout's ledger
as not staged (with why) — crash visibly instead of letting a call through unrecorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..errors import CaptureUnavailable, Conflict, ProxyError, TooManyRequests, Unprocessable
from ..schemas.digest import EncodingError, RequestValueCache, encode_request, seal_record
from ..schemas.events import EventDraft, EventKind, RolloutEvent, claim_event, token_in_event
from ..schemas.message_memo import MessageMemo, rollout_digester
from ..schemas.outcome import RolloutOutcome
from ..schemas.records import (
    LOGPROBS_MODE_UNKNOWN,
    Attachment,
    CallStatus,
    LedgerEntry,
    RecordValidationError,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
    StageResult,
)
from ..schemas.tokens import full_sequence
from ..sinks.base import DuplicateSeq, StagingSink, StagingSource
from ..sinks.codec import MESSAGE_KEYS
from .call import SAMPLING_KEYS, Call, CallReport, CompletionLike, log_claim, sampling_of
from .experts import ExpertsPlan, record_experts
from .handback import MAX_RESEQ, Handback
from .ids import new_call_id
from .ledger import LedgerWriter
from .outcomes import HeaderLocks, check_driver_metadata, with_outcome
from .policy import PolicyError, RequestPolicy, check_policy
from .refusal_folds import RefusalFolds
from .resumes import RESUME_REFUSALS, Resumes
from .rollouts import (
    KEY_HASH_FIELD,
    CallOutcome,
    RolloutLive,
    record_bytes,
    request_identity,
    request_key,
    resume_rollout,
)
from .staging import Stager
from .weights import DECREASED_FROM, state_header, stored_weight_version

__all__ = ["SAMPLING_KEYS", "Call", "CallReport", "Capture", "CompletionLike", "sampling_of"]

log = logging.getLogger("capture_proxy.capture")

#: Ids of sealed rollouts remembered (not their state) so late calls get their 409 without a
#: store lookup; about 200 bytes each (with the key hash of a keyed rollout). The most recently
#: sealed: a late call comes soon after its rollout's seal (a forgotten one is read from the
#: store, which finds a sealed rollout without holding it by id). 100,000 took 20 MB, filling
#: for over an hour at full rate (docs/reports/reliability.md, section 6).
_SEALED_IDS_KEPT = 4_096


class Capture:
    """Admits calls, builds their records, stages them through a `StagingSink`, keeps the ledger.

    `stage_timeout`: a sink slower than this makes the call `capture_failed`; if the write still
    lands later, the record is marked orphaned (so no trainer uses it unknowingly).
    `max_pending`: staging writes in progress at once (including late ones); beyond it new calls
    are refused with 503 before anything is forwarded — back-pressure, never an unbounded queue.
    `max_rollout_calls`, `max_rollout_bytes`: per-rollout quotas (0: none); a call past either is
    refused with 429 naming the quota, so one sandbox cannot fill the store for every other.
    """

    def __init__(
        self,
        sink: StagingSink,
        *,
        stage_timeout: float = 10.0,
        max_pending: int = 256,
        max_inflight: int = 0,
        max_inflight_per_rollout: int = 0,
        max_held_ledger: int = 100_000,
        source: Callable[[], StagingSource] | None = None,
        max_live_rollouts: int = 10_000,
        policy: RequestPolicy | None = None,
        max_rollout_calls: int = 0,
        max_rollout_bytes: int = 0,
        pause_hold: float = 30.0,
        max_rollout_refusal_rows: float = 0.0,
        resume_timeout: float = 20.0,
    ) -> None:
        self.sink = sink
        self.policy = policy or RequestPolicy()
        #: Opens a reader on the same store: rollouts seen again after a restart resume from it.
        self.source = source
        #: Rollouts being read back from the store, each call waiting `resume_timeout` at most.
        self.resumes = (
            Resumes(source, resume_timeout, self._take_resumed) if source is not None else None
        )
        self.max_live_rollouts = max_live_rollouts
        #: Per-rollout quotas (0: none), checked at admission: see `check_admission`.
        self.max_rollout_calls = max_rollout_calls
        self.max_rollout_bytes = max_rollout_bytes
        #: Sealed rollout id -> its key hash (None if unkeyed): its own key still gets a 409.
        self._sealed: OrderedDict[str, str | None] = OrderedDict()
        self.stager = Stager(sink, timeout=stage_timeout, max_pending=max_pending)
        self.max_inflight = max_inflight
        self.max_inflight_per_rollout = max_inflight_per_rollout
        self._weight_version = 0
        #: Counts the versions this process set, so a re-read of the store that began before a
        #: set does not put the older version back (`refresh_weight_version`).
        self._weight_sets = 0
        self.rollouts: dict[str, RolloutLive] = {}
        self.inflight = 0
        self.ledger = LedgerWriter(sink, timeout=stage_timeout, max_held=max_held_ledger)
        #: Refusals past ``--max-rollout-refusal-rows`` a second, written together.
        self.refusal_folds = RefusalFolds(max_rollout_refusal_rows, self.ledger.write)
        #: A rollout another proxy continued while this one held it: its calls and ledger
        #: entries go to free seqs (`core/handback.py`).
        self.handback = Handback(self)
        self.ledger.reseq = self.handback.entry_at_free_seq
        self.unavailable_reason: str | None = None  # set by the disk guard
        #: Called with a `CallReport` once per call outcome (metrics subscribe here). A
        #: subscriber must be quick and must not raise.
        self.on_outcome: list[Callable[[CallReport], None]] = []
        #: Encodes the tool definitions every call of a session repeats once (same digests).
        self._request_values = RequestValueCache()
        # Each rollout's messages hashed once for its digests, not once per call.
        self._message_digests: MessageMemo[bytes] = MessageMemo()
        #: Serializes the writes of each rollout's header (creation, seal, outcomes).
        self._headers = HeaderLocks()
        #: Set while calls are admitted; cleared by a weight-update pause (`pause`). A new call
        #: waits up to `pause_hold` seconds for it, then gets 503 ``paused``.
        self._admitting = asyncio.Event()
        self._admitting.set()
        self.pause_hold = pause_hold
        #: The calls in flight by id: what a pause waits for, and cuts at its deadline.
        self.calls: dict[str, Call] = {}
        self._idle = asyncio.Event()  # set while `calls` is empty
        self._idle.set()

    # -- weight-update pause -------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self._admitting.is_set()

    def pause(self) -> bool:
        """Stop admitting calls; returns whether admission was already paused."""
        was = self.paused
        self._admitting.clear()
        return was

    def resume(self) -> None:
        """Admit calls again; calls being held go on."""
        self._admitting.set()

    def _paused_error(self) -> CaptureUnavailable:
        # 503 with Retry-After, not 429: clients such as OpenCode's SDK retry a 503 as long as
        # it comes back, while they give up on 429 after a few tries.
        return CaptureUnavailable(
            "the proxy is paused for a weight update (POST /admin/weights/pause); retry later",
            code="paused",
            headers={"Retry-After": "5"},
        )

    async def hold_while_paused(self) -> None:
        """Return once calls are admitted, waiting up to `pause_hold` seconds while paused;
        raise 503 ``paused`` if the pause outlasts that."""
        if not self.paused:
            return
        try:
            await asyncio.wait_for(self._admitting.wait(), self.pause_hold)
        except TimeoutError:
            raise self._paused_error() from None

    async def wait_idle(self, wait_s: float) -> list[Call]:
        """Wait up to `wait_s` seconds for the calls in flight to end; the ones still running."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), wait_s)
        return list(self.calls.values())

    def cut(self, calls: list[Call], reason: str) -> list[Call]:
        """Cancel the tasks of `calls` (their handlers record them ``aborted`` with `reason`);
        the ones cut. A call already staging is left to finish: its answer is complete."""
        cut: list[Call] = []
        for call in calls:
            if call.finished or call.staging or call.task is None or call.task.done():
                continue
            call.cut = reason
            call.task.cancel()
            cut.append(call)
        return cut

    # -- weight version ------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """The weight version stamped on calls admitted now (0 until set). Read-only: set it with
        `set_weight_version`, which stores it first."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        # Assigning would stamp calls with a version the store does not hold (a restart would
        # forget it) and skip the checks: there is one way to set it.
        raise AttributeError(
            "Capture.weight_version is read-only: set it with `await set_weight_version(version)`"
            " (CaptureClient.set_weight_version, PUT /admin/weight-version), which stores it "
            "before calls are stamped with it"
        )

    async def set_weight_version(self, version: int) -> None:
        """Stamp later calls with `version`, once the store holds it (a restart restores it).

        Raises `Unprocessable` (422, ``param`` ``weight_version``) for anything but an integer
        of 0 or more, and `CaptureUnavailable` (503) when the store cannot take it; the version
        in use then stays what it was, so no call is stamped with a version a restart would
        forget. A version lower than the previous one is taken (a rollback to a checkpoint):
        each rollout's next call is flagged instead (`capture_proxy.core.weights`).
        """
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise Unprocessable(
                f"the weight version must be an integer of 0 or more, got {version!r}",
                code="invalid_value",
                param="weight_version",
            )
        try:
            await self.sink.put_rollout(state_header(version))
        except Exception as exc:  # any sink failure: the driver must learn it was not applied
            raise CaptureUnavailable(
                f"the weight version {version} could not be stored ({exc}); calls are still "
                f"stamped {self._weight_version}",
                code="weight_version_not_stored",
                headers={"Retry-After": "1"},
            ) from exc
        self._weight_version = version
        self._weight_sets += 1

    async def restore_weight_version(self, *, listed_within_s: float = 0.0) -> int:
        """Take up the weight version last set on the store; returns the version stamped now.

        At start, and again while serving (`refresh_weight_version`): the version belongs to
        the store, so every proxy on one store stamps the version any of them set last.
        `listed_within_s`: a store listing the reader took that recently will do (at start,
        the one the sink's open took; `stored_weight_version`).
        """
        if self.source is None:
            return self._weight_version
        sets = self._weight_sets
        stored = await asyncio.to_thread(
            functools.partial(stored_weight_version, listed_within_s=listed_within_s),
            self.source,
        )
        # A version this process set while the store was read is newer than what was read.
        if stored is not None and sets == self._weight_sets:
            self._weight_version = stored
        return self._weight_version

    async def refresh_weight_version(self) -> int:
        """`restore_weight_version` while serving: logs a version another proxy on the store
        set, keeps the version in use when the store cannot be read (logged)."""
        before = self._weight_version
        try:
            version = await self.restore_weight_version()
        except Exception as e:  # the store unreadable for now: the next re-read tries again
            log.warning("weight version: the store could not be read (%s); still %d", e, before)
            return before
        if version != before:
            log.info(
                "weight version %d, set on the store by another proxy (was %d)", version, before
            )
        return version

    # -- rollouts ------------------------------------------------------------------------------

    def rollout(self, rollout_id: str) -> RolloutLive | None:
        """The rollout as this process holds it now, or None. Never creates one and never reads
        the store: a path that admits, refuses or seals a call resolves it with `ensure_rollout`
        or `find_rollout`, so a rollout this process no longer holds (a restart, eviction)
        resumes from the store instead of restarting at seq 0."""
        live = self.rollouts.get(rollout_id)
        if live is None and rollout_id in self._sealed:
            return self._sealed_placeholder(rollout_id)  # refuses calls; never held live
        return live

    def _sealed_placeholder(self, rollout_id: str) -> RolloutLive:
        return RolloutLive(rollout_id, sealed=True, key_sha256=self._sealed[rollout_id])

    async def ensure_rollout(self, rollout_id: str) -> RolloutLive:
        """The live rollout, resumed from the store if an earlier process staged into it.

        Resuming keeps sequence numbers, lineage, retries, seal state, the poisoned flag and the
        rollout's key continuous across a restart of the proxy.
        """
        live = await self.find_rollout(rollout_id)
        if live is None:
            live = self.rollouts.get(rollout_id)  # created meanwhile by a concurrent call
            if live is None:
                live = RolloutLive(rollout_id, created_at_ms=int(time.time() * 1000))
                self._evict()
                self.rollouts[rollout_id] = live
        return live

    async def find_rollout(self, rollout_id: str) -> RolloutLive | None:
        """The live rollout, or the store's (then made live), or None: never creates one.

        No lock: concurrent first calls of one rollout may both read the store; the first to
        come back registers its copy and the others use it.
        """
        live = self.rollouts.get(rollout_id)
        if live is None and rollout_id in self._sealed:
            return self._sealed_placeholder(rollout_id)
        if live is not None or self.resumes is None:
            return live
        return self._take_resumed(rollout_id, await self.resumes.read(rollout_id))

    def _take_resumed(self, rollout_id: str, found: RolloutLive | None) -> RolloutLive | None:
        """Hold a rollout read from the store (`Resumes`), unless a copy is held already: the
        one held, or None. Called when the read ends, even after its call gave up waiting."""
        live = self.rollouts.get(rollout_id)
        if live is not None or found is None:
            return live
        if found.sealed:
            self.remember_sealed(found)  # looked at for its 409: not held live
            return found
        log.info("resumed rollout %s from the store at seq %d", rollout_id, found.next_seq)
        self._evict()
        self.rollouts[rollout_id] = found
        return found

    def evict_idle(self, idle_s: float) -> list[str]:
        """Release rollouts with nothing in flight and no call for `idle_s` seconds; a later
        call resumes them from the store. Keeps memory bounded by live work, not by every
        rollout ever seen (each holds the index of its token sequences). Returns the ids
        released."""
        if not self._store_caught_up():
            return []
        cutoff = time.monotonic() - idle_s
        idle = [
            rid
            for rid, r in self.rollouts.items()
            if r.in_flight == 0 and r.last_active and r.last_active < cutoff
        ]
        for rid in idle:
            del self.rollouts[rid]
            self._forget_messages(rid)
        return idle

    def remember_sealed(self, live: RolloutLive) -> None:
        self._sealed[live.rollout_id] = live.key_sha256
        while len(self._sealed) > _SEALED_IDS_KEPT:
            self._sealed.popitem(last=False)  # forgotten ids are looked up in the store again

    def _store_caught_up(self) -> bool:
        # A rollout may leave memory only when the store holds all of it: a ledger entry still
        # held in memory or still being written would be missing from the resumed rollout, and
        # its sequence number handed out again.
        return not self.ledger.held and not self.ledger.late

    def _evict(self) -> None:
        # Oldest idle rollouts first; a rollout seen again later resumes from the store.
        excess = len(self.rollouts) - self.max_live_rollouts + 1
        if excess <= 0 or not self._store_caught_up():
            return
        idle = [rid for rid, r in self.rollouts.items() if r.in_flight == 0][:excess]
        for rid in idle:
            del self.rollouts[rid]
            self._forget_messages(rid)

    def _forget_messages(self, rollout_id: str) -> None:
        # Both memos of a rollout's messages (the digest's here, the stores' blob keys in the
        # codec) hold live work only: without this the codec's would fill to its bound on a
        # proxy that runs for weeks (the soak's RSS slope).
        self._message_digests.forget(rollout_id)
        MESSAGE_KEYS.forget(rollout_id)

    async def create_rollout(
        self,
        rollout_id: str,
        *,
        key: str | None = None,
        policy: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        token_in: bool | None = None,
    ) -> RolloutLive:
        """Create a rollout (409 when it exists). `token_in` is its token-in choice (None: the
        proxy's setting), kept in its event log so a restarted proxy keeps it."""
        try:
            checked = check_policy(policy or {}, "policy")
        except PolicyError as e:
            raise Unprocessable(str(e), code="invalid_policy", param="policy") from e
        check_driver_metadata(dict(metadata or {}))
        # Known here or in the store (created, called or sealed by an earlier process): taken.
        if await self.find_rollout(rollout_id) is not None:
            raise Conflict(f"rollout {rollout_id} already exists", code="rollout_exists")
        live = RolloutLive(rollout_id, created_at_ms=int(time.time() * 1000))
        live.key_sha256 = hashlib.sha256(key.encode()).hexdigest() if key is not None else None
        live.policy = checked
        live.metadata = dict(metadata or {})
        live.token_in = token_in
        self._evict()
        self.rollouts[rollout_id] = live  # no await since the lookup: nobody registered it since
        async with self._headers.hold(rollout_id):
            await self.sink.put_rollout(self._header(live))
        if token_in is not None:
            at_ms = int(time.time() * 1000)
            await self.sink.append_event(token_in_event(rollout_id, token_in, at_ms))
        return live

    def _header(self, live: RolloutLive) -> RolloutInfo:
        """The header to store for a live rollout (sealed once its seal is written)."""
        return RolloutInfo(
            live.rollout_id,
            RolloutState.OPEN if live.sealed_at_ms is None else RolloutState.SEALED,
            live.poisoned,
            live.created_at_ms,
            live.sealed_at_ms,
            {**live.metadata, KEY_HASH_FIELD: live.key_sha256}
            if live.key_sha256
            else live.metadata,
            live.policy,
            live.outcome_history,
        )

    async def seal(self, rollout_id: str, wait_s: float) -> RolloutLive:
        """Refuse new calls for the rollout, wait for its in-flight calls (up to `wait_s`)."""
        live = await self.find_rollout(rollout_id)
        if live is None:
            raise KeyError(rollout_id)
        if live.sealed and self.rollouts.get(rollout_id) is not live:
            # Sealed earlier and released from memory: nothing to wait for or write (writing
            # this copy's header could replace the stored one); answer the stored rollout.
            if self.source is not None:
                stored = await asyncio.to_thread(resume_rollout, self.source, rollout_id)
                if stored is not None:
                    await self._seal_event_missing(rollout_id)
                    return stored
            return live
        newly_sealed = not live.sealed
        live.sealed = True
        try:
            await asyncio.wait_for(live.idle.wait(), wait_s)
        except TimeoutError:
            log.warning(
                "seal %s: %d calls still in flight after %.1fs", rollout_id, live.in_flight, wait_s
            )
        async with self._headers.hold(rollout_id):
            live.sealed_at_ms = int(time.time() * 1000)
            # The seal event first, then the header: readers list a rollout as sealed by its
            # header (the rollout index, batches), and a verified read holds a sealed header to
            # a seal event, which is then always there already. A stop between the two leaves a
            # rollout sealed in its log and open in its header: not read as sealed, and sealed
            # again (event and header) by the driver's retry.
            if newly_sealed:
                await self.sink.append_event(
                    EventDraft(rollout_id, EventKind.SEAL, live.sealed_at_ms)
                )
            else:  # a seal sent again, perhaps after one whose event could not be written
                await self._seal_event_missing(rollout_id)
            await self.sink.put_rollout(self._header(live))
        if live.in_flight == 0 and self.rollouts.get(rollout_id) is live:
            # A sealed rollout takes no more calls: memory holds live work only (its id, for
            # the 409s). A manifest request reads it from the store.
            del self.rollouts[rollout_id]
            self.remember_sealed(live)
            self._forget_messages(rollout_id)
        return live

    async def _seal_event_missing(self, rollout_id: str) -> None:
        """Write the seal event of a rollout whose header says sealed and whose event log does
        not: the proxy stopped between the two writes of a seal. Verified reads hold the header
        to the chain, so the driver's seal sent again completes it."""
        open_source = self.source
        if open_source is None:
            return
        events = await asyncio.to_thread(lambda: open_source().events(rollout_id))
        if events and not any(e.kind == EventKind.SEAL for e in events):
            log.warning(
                "rollout %s: sealed in its header only; its seal event is written now", rollout_id
            )
            await self.sink.append_event(
                EventDraft(rollout_id, EventKind.SEAL, int(time.time() * 1000))
            )

    async def put_outcome(self, rollout_id: str, outcome: RolloutOutcome) -> RolloutInfo:
        """Store `outcome` as the rollout's latest, open or sealed; returns the header written.

        The history keeps every earlier outcome. Raises KeyError for a rollout neither this
        process nor the store knows, `Conflict` (409) past `MAX_OUTCOMES`, and
        `CaptureUnavailable` (503) when the store cannot take it: then nothing changed.
        """
        async with self._headers.hold(rollout_id):
            live = await self.find_rollout(rollout_id)
            if live is None:
                raise KeyError(rollout_id)
            held = self.rollouts.get(rollout_id) is live
            if held:
                history = with_outcome(rollout_id, live.outcome_history, outcome)
                header = replace(self._header(live), outcome_history=history)
            else:
                # Sealed and released from memory: the stored header is the whole truth
                # (its seal time, metadata and outcomes), and is written back as it is.
                open_source = self.source
                if open_source is None:
                    raise KeyError(rollout_id)
                stored = await asyncio.to_thread(lambda: open_source().rollout_info(rollout_id))
                history = with_outcome(rollout_id, stored.outcome_history, outcome)
                header = replace(stored, outcome_history=history)
            # The outcome's event first, then the header that holds it: readers list a rollout
            # as graded by its header (the rollout index, batches), and a verified read holds
            # the header's latest outcome to the event log's, which then has it already. A
            # failure after the event leaves the header behind: the driver is told, and its
            # retry writes both (docs/contract.md, "What verified means").
            reward = outcome.reward
            body = {
                "reward": dict(reward) if isinstance(reward, Mapping) else reward,
                "group_id": outcome.group_id,
                "revision": len(history),
            }
            try:
                await self.sink.append_event(
                    EventDraft(rollout_id, EventKind.OUTCOME, outcome.at_ms, body=body)
                )
            except Exception as exc:  # any sink failure: the driver must learn it was not kept
                raise CaptureUnavailable(
                    f"the outcome of rollout {rollout_id} could not be stored ({exc}); "
                    "nothing was changed",
                    code="outcome_not_stored",
                    headers={"Retry-After": "1"},
                ) from exc
            try:
                await self.sink.put_rollout(header)
            except Exception as exc:
                raise CaptureUnavailable(
                    f"the outcome of rollout {rollout_id} is in its event log but its header "
                    f"could not be stored ({exc}); nothing was changed in the header: send it "
                    "again (until then verified reads leave the rollout out)",
                    code="outcome_not_stored",
                    headers={"Retry-After": "1"},
                ) from exc
            if held:
                live.outcome_history = history
            return header

    # -- calls ---------------------------------------------------------------------------------

    def check_admission(self, live: RolloutLive, size: int = 0) -> None:
        """Raise the error a new call of this rollout gets now, if any (nothing forwarded yet).

        `size` is the call's body size, reserved against the byte quota while it is in flight.
        """
        if live.sealed:
            raise Conflict(f"rollout {live.rollout_id} is sealed", code="rollout_sealed")
        self._check_quotas(live, size)
        if self.paused:  # paused after `hold_while_paused` let it through (an offloaded call)
            raise self._paused_error()
        if self.unavailable_reason is not None:
            raise CaptureUnavailable(
                f"not accepting calls: {self.unavailable_reason}",
                code="capture_unavailable",
                headers={"Retry-After": "5"},
            )
        if self.stager.full:
            raise CaptureUnavailable(
                f"{self.stager.pending} staging writes pending (limit {self.stager.max_pending})",
                code="staging_backlog",
                headers={"Retry-After": "1"},
            )
        if self.max_inflight and self.inflight >= self.max_inflight:
            raise TooManyRequests(
                f"{self.inflight} calls in flight (limit {self.max_inflight})",
                code="too_many_inflight",
                headers={"Retry-After": "1"},
            )
        if self.max_inflight_per_rollout and live.in_flight >= self.max_inflight_per_rollout:
            raise TooManyRequests(
                f"rollout {live.rollout_id} has {live.in_flight} calls in flight "
                f"(limit {self.max_inflight_per_rollout})",
                code="too_many_inflight_rollout",
                headers={"Retry-After": "1"},
            )

    def _check_quotas(self, live: RolloutLive, size: int) -> None:
        # 429, not 403 or 413: the rollout used up its allowance (as an API answers a spent
        # quota); the request itself is fine. No Retry-After: waiting frees nothing. Clients
        # that retry 429s (the OpenAI SDKs, OpenCode) give up after a few tries.
        if self.max_rollout_calls and live.calls_used >= self.max_rollout_calls:
            raise TooManyRequests(
                f"rollout {live.rollout_id} has made {live.calls_used} calls: its call quota "
                f"(--max-rollout-calls {self.max_rollout_calls}) is spent",
                code="rollout_call_quota",
            )
        used = live.bytes_staged + live.bytes_reserved
        limit = self.max_rollout_bytes
        if limit and (used >= limit or used + size > limit):
            raise TooManyRequests(
                f"rollout {live.rollout_id} has staged {used} bytes (with calls in flight); "
                f"a call of {size} more would pass its byte quota "
                f"(--max-rollout-bytes {limit})",
                code="rollout_byte_quota",
            )

    def begin_call(
        self,
        rollout_id: str,
        request: Mapping[str, Any],
        attachments: Mapping[str, Attachment] | None = None,
        *,
        key: bytes | None = None,
        size: int = 0,
        experts: ExpertsPlan | None = None,
    ) -> Call:
        """Admit a call: assign its id and sequence number, link retries, stamp the weight version,
        choose where its routed experts start.

        Resolve the rollout first with `ensure_rollout` (it may have to read the store).
        `key` is the request's `request_key` when the caller has computed it already; `size`
        the body's size, held against the rollout's byte quota until the call ends; `experts`
        the rollout's `ExpertsIndex.plan` for the request, when computed already.
        Raises a `ProxyError` (409 sealed, 429/503 limits) when the call must not proceed.
        """
        live = self.rollout(rollout_id)
        if live is None:
            # Released from memory since it was resolved (idle or over the live-rollout cap):
            # only the store knows its next sequence number now, so never start it afresh.
            raise CaptureUnavailable(
                f"rollout {rollout_id} is not loaded: resolve it (ensure_rollout) and retry",
                code="rollout_not_loaded",
                headers={"Retry-After": "0"},
            )
        self.check_admission(live, size)
        request_size = None
        if key is None:
            key, request_size = request_identity(request)
        previous, live.last_weight_version = live.last_weight_version, self.weight_version
        decreased = previous if previous is not None and self.weight_version < previous else None
        if decreased is not None:
            log.warning(
                "rollout %s: call stamped weight version %d after %d (flagged in its record)",
                rollout_id,
                self.weight_version,
                decreased,
            )
        call = Call(
            call_id=new_call_id(),
            rollout_id=rollout_id,
            seq=live.take_seq(),
            request=request,
            attachments=attachments or {},
            request_key=key,
            retry_of=live.retry_of(key),
            weight_version=self.weight_version,
            admitted_ms=int(time.time() * 1000),
            rollout=live,
            reserved=size,
            weight_version_decreased_from=decreased,
            experts=experts if experts is not None else live.experts.plan(request),
            request_size=request_size,
        )
        live.calls_used += 1
        live.bytes_reserved += size
        live.remember_request(key, call.call_id)
        live.outcomes[call.call_id] = CallOutcome(
            call.seq,
            call.call_id,
            "pending",
            retry_of=call.retry_of,
            weight_version_decreased_from=decreased,
        )
        live.enter()
        self.inflight += 1
        call.task = asyncio.current_task()
        self.calls[call.call_id] = call
        self._idle.clear()
        call.claim = self.start_claim(call)
        return call

    def start_claim(self, call: Call) -> asyncio.Future[RolloutEvent]:
        draft = claim_event(call.rollout_id, call.seq, call.call_id, call.admitted_ms)
        task = asyncio.ensure_future(self.sink.append_event(draft))
        task.add_done_callback(functools.partial(log_claim, call))
        return task

    def _claim_refusal(self, call: Call) -> StageResult | None:
        """The ``capture_failed`` result a call gets when its claim failed, or None (claimed, or
        not settled yet). ``duplicate_seq``: another call holds the seq (a second proxy on the
        rollout); ``sink_error``: the store could not write it (the reason staging gives)."""
        claim = call.claim
        if claim is None or not claim.done() or claim.cancelled():
            return None
        error = claim.exception()
        if error is None:
            return None
        if isinstance(error, DuplicateSeq):
            return StageResult.failed("duplicate_seq", f"the seq could not be claimed: {error}")
        self.stager.sink_failing = f"{type(error).__name__}: {error}"
        return StageResult.failed(
            "sink_error", f"claiming seq {call.seq} failed: {type(error).__name__}: {error}"
        )

    def _forget_stale(self, call: Call) -> None:
        """Another call holds this call's seq: another proxy continued the rollout while this
        one held it (a handoff, then this proxy came back). What is held here is stale: the
        rollout's next call resumes it from the store, after the highest claimed seq. (Without
        a store to read, memory is all there is: the copy stays, poisoned.)"""
        if self.source is not None and self.rollouts.get(call.rollout_id) is call.rollout:
            del self.rollouts[call.rollout_id]
            log.warning(
                "rollout %s: seq %d is held by another call (another proxy continued it); "
                "its next call resumes it from the store",
                call.rollout_id,
                call.seq,
            )

    async def _staged_unclaimed(self, call: Call) -> StageResult | None:
        """After the call's record was staged: None once its claim is durable too, else the
        ``capture_failed`` result it gets instead (its record marked orphaned).

        The claim's write was queued before the record's, and a group-commit writer commits in
        queue order, so the claim is settled by now in practice; waiting for it is the rule
        "never staged without a claim" made explicit. A claim that failed while its record
        landed (a later batch) leaves a record no trainer may take as a normal one: orphaned.
        """
        claim = call.claim
        if claim is None:
            return None
        if not claim.done():  # settled already in practice: then no timer, no extra future
            with contextlib.suppress(Exception):  # its outcome is read below
                await asyncio.wait_for(asyncio.shield(claim), self.stager.timeout)
        refused = self._claim_refusal(call)
        if refused is None and not claim.done():
            refused = StageResult.failed(
                "stage_timeout",
                f"the store took longer than {self.stager.timeout:g}s to claim seq {call.seq}",
            )
        if refused is not None:
            try:
                await self.sink.mark_orphaned(call.call_id, refused.reason or "sink_error")
            except Exception as e:  # the capture_failed ledger entry still says what happened
                log.error("could not mark %s orphaned: %s", call.call_id, e)
        return refused

    async def begin_call_offloaded(
        self,
        rollout_id: str,
        request: Mapping[str, Any],
        attachments: Mapping[str, Attachment] | None = None,
        *,
        size: int = 0,
    ) -> Call:
        """`begin_call` for a large request: its request key now, and its record's digest when
        it completes, are computed on a worker thread, so other calls are served meanwhile.

        Both walk the whole request (the digest in Python, object by object); a thread hop
        costs ~0.1 ms, so small requests are better served by `begin_call`.
        """
        live = self.rollout(rollout_id)
        index = live.experts if live is not None else None

        # The experts lookup only reads the index: a call staged meanwhile is not a candidate
        # for this one, which then asks for more positions than it needed, never fewer.
        def keys() -> tuple[bytes, ExpertsPlan | None]:
            return request_key(request), index.plan(request) if index is not None else None

        key, experts = await asyncio.to_thread(keys)
        call = self.begin_call(
            rollout_id, request, attachments, key=key, size=size, experts=experts
        )
        call.offload = True
        return call

    def _finish(self, call: Call) -> None:
        if not call.finished:
            call.finished = True
            call.rollout.bytes_reserved -= call.reserved
            call.rollout.leave()
            self.inflight -= 1
            self.calls.pop(call.call_id, None)
            if not self.calls:
                self._idle.set()

    def prepare_record(self, call: Call) -> None:
        """Compute what the call's record needs from its request alone (the request's part of
        the digest), so that sealing it once the answer is in costs less; the exchange calls
        this while the upstream generates. A request that cannot be encoded is left for
        `build_record`, which refuses it (``invalid_record``) when the call is staged."""
        if call.request_part is not None or call.staging or call.finished:
            return
        with contextlib.suppress(EncodingError):
            call.request_part = encode_request(
                call.request,
                digester=rollout_digester(self._message_digests, call.rollout_id),
                encoder=self._request_values,
            )

    def build_record(
        self,
        call: Call,
        completion: CompletionLike,
        *,
        model: str,
        upstream_version: str,
        tokenizer_fingerprint: str,
        sampling: Mapping[str, Any],
        logprobs_mode: str = LOGPROBS_MODE_UNKNOWN,
        effective_sampling: Mapping[str, Any] | None = None,
        engine_weight_version: str | None = None,
        weight_spans: Sequence[tuple[str, int, int]] = (),
        token_in: bool = False,
        bridge_spans: Sequence[tuple[int, int, str]] = (),
    ) -> StagedCallRecord:
        """The sealed record for a completed call (raises RecordValidationError/EncodingError).

        `logprobs_mode` is the upstream's, as far as the proxy knows it; `effective_sampling`
        the sampling it applied after its own defaults (None: unknown); `engine_weight_version`
        and `weight_spans` the engine's own weight version and which completion tokens it sampled
        (None and ``[]``: unknown); `token_in` whether the call went token-in and `bridge_spans`
        the prompt tokens the proxy inserted (docs/token-in.md).
        """
        parent = call.rollout.choose_parent(completion.prompt_token_ids, call.request_key)
        extras = completion.extras
        if call.weight_version_decreased_from is not None:
            extras = {**extras, DECREASED_FROM: call.weight_version_decreased_from}
        experts, call.experts_entry = record_experts(
            call.experts,
            call.request,
            completion.message,
            completion.prompt_token_ids,
            completion.completion_token_ids,
            extras,
            call.seq,
            call.call_id,
        )
        if experts:
            extras = {**extras, **experts}
        record = StagedCallRecord(
            rollout_id=call.rollout_id,
            call_id=call.call_id,
            seq=call.seq,
            model=model,
            finish_reason=completion.finish_reason,
            request=call.request,
            response=completion.message,
            prompt_token_ids=completion.prompt_token_ids,
            completion_token_ids=completion.completion_token_ids,
            completion_logprobs=completion.completion_logprobs,
            parent_call_id=parent,
            retry_of=call.retry_of,
            created_at_ms=call.admitted_ms,
            weight_version=call.weight_version,
            upstream_version=upstream_version,
            tokenizer_fingerprint=tokenizer_fingerprint,
            sampling=dict(sampling),
            extras=extras,
            logprobs_mode=logprobs_mode,
            effective_sampling=(
                dict(effective_sampling) if effective_sampling is not None else None
            ),
            engine_weight_version=engine_weight_version,
            weight_spans=weight_spans,
            token_in=token_in,
            bridge_spans=bridge_spans,
            replica=call.replica,
        )
        sealed = seal_record(
            record,
            attachments=call.attachments,
            encoder=self._request_values,
            digester=rollout_digester(self._message_digests, call.rollout_id),
            request_part=call.request_part,
        )
        call.record_bytes = record_bytes(
            sealed, call.attachments.values(), request_size=call.request_size
        )
        return sealed

    async def complete_call(
        self,
        call: Call,
        completion: CompletionLike,
        *,
        model: str,
        upstream_version: str = "",
        tokenizer_fingerprint: str = "",
        sampling: Mapping[str, Any] | None = None,
        logprobs_mode: str = LOGPROBS_MODE_UNKNOWN,
        effective_sampling: Mapping[str, Any] | None = None,
        engine_weight_version: str | None = None,
        weight_spans: Sequence[tuple[str, int, int]] = (),
        token_in: bool = False,
        bridge_spans: Sequence[tuple[int, int, str]] = (),
    ) -> StageResult:
        """Build, seal and stage the call's record. Never raises for capture problems: a call that
        cannot be staged returns ``capture_failed`` and is in the ledger, its rollout poisoned.
        """
        call.staging = True
        t0 = time.perf_counter()
        try:
            build = functools.partial(
                self.build_record,
                call,
                completion,
                model=model,
                upstream_version=upstream_version,
                tokenizer_fingerprint=tokenizer_fingerprint,
                sampling=sampling if sampling is not None else sampling_of(call.request),
                logprobs_mode=logprobs_mode,
                effective_sampling=effective_sampling,
                engine_weight_version=engine_weight_version,
                weight_spans=weight_spans,
                token_in=token_in,
                bridge_spans=bridge_spans,
            )
            result, landed = await self._stage_once(call, build)
            # Its seq is another call's: another proxy continued the rollout while this one
            # held it (core/handback.py). Read it again and stage the call at the next free
            # seq, unless its record landed already (then marked orphaned: capture_failed).
            for _ in range(MAX_RESEQ):
                if landed or result.reason != "duplicate_seq":
                    break
                if not await self.handback.to_next_free_seq(call):
                    break
                result, landed = await self._stage_once(call, build)
            if result.reason == "duplicate_seq":
                self._forget_stale(call)
            if result.status is CallStatus.STAGED:
                assert result.coords is not None
                call.rollout.bytes_staged += call.record_bytes
                call.rollout.add_lineage(
                    call.seq,
                    call.call_id,
                    full_sequence(completion.prompt_token_ids, completion.completion_token_ids),
                    call.request_key,
                )
                if call.experts_entry is not None:
                    call.rollout.experts.add(*call.experts_entry)
                call.rollout.outcomes[call.call_id] = CallOutcome(
                    call.seq,
                    call.call_id,
                    CallStatus.STAGED,
                    coords=result.coords,
                    retry_of=call.retry_of,
                    weight_version_decreased_from=call.weight_version_decreased_from,
                )
                done = time.perf_counter()
                overhead = None
                if call.started is not None and call.upstream_seconds is not None:
                    overhead = max(0.0, done - call.started - call.upstream_seconds)
                self._report(
                    CallReport(
                        call.rollout_id,
                        call.call_id,
                        CallStatus.STAGED,
                        "ok",
                        result.coords,
                        len(call.attachments),
                        done - t0,
                        call.upstream_seconds,
                        overhead,
                        call.replica,
                    )
                )
            else:
                await self._record_not_staged(
                    call,
                    CallStatus.CAPTURE_FAILED,
                    result.reason or "capture_failed",
                    result.message or "",
                    None,
                    attachments=len(call.attachments),
                    stage_seconds=time.perf_counter() - t0,
                )
            return result
        finally:
            self._finish(call)

    async def _stage_once(
        self, call: Call, build: Callable[[], StagedCallRecord]
    ) -> tuple[StageResult, bool]:
        """Build and stage the call's record at its seq: the result, and whether the record
        landed in the store (staged, or staged and then refused for its claim: orphaned)."""
        # A claim that already failed: nothing to stage. One still on its way does not hold
        # the call up: the record queues behind it (and is checked against it below).
        refused = self._claim_refusal(call)
        if refused is not None:
            return refused, False
        try:
            record = await asyncio.to_thread(build) if call.offload else build()
        except (RecordValidationError, EncodingError) as e:
            return StageResult.failed("invalid_record", str(e)), False
        result = await self.stager.stage(record, call.attachments)
        if result.status is CallStatus.STAGED:
            return await self._staged_unclaimed(call) or result, True
        return result, False

    async def fail_call(
        self,
        call: Call,
        status: CallStatus,
        reason: str,
        message: str,
        http_status: int | None = None,
    ) -> None:
        """Record an admitted call that ended without a record (upstream error, abort, ...)."""
        try:
            # No wait for the claim: the ledger entry queues behind it and accounts for the seq
            # whatever became of the claim (an entry at a seq another call claimed is refused
            # and logged by the ledger writer).
            await self._record_not_staged(call, status, reason, message, http_status)
        finally:
            self._finish(call)

    async def reject(
        self, rollout_id: str, reason: str, message: str, http_status: int, *, replica: str = ""
    ) -> str:
        """Record a call refused before it was admitted (a 4xx); returns its call id.

        The rollout is resolved first (from the store if this process does not hold it), so the
        refusal takes the next sequence number. A sealed rollout's ledger is closed: the refusal
        becomes `Conflict` (409, ``rollout_sealed``) and nothing is written.
        """
        live = await self.ensure_rollout(rollout_id)
        if live.sealed:
            raise Conflict(f"rollout {rollout_id} is sealed", code="rollout_sealed")
        # A refusal before its call was routed (paused, a body refused before it was decoded)
        # is still one of its pinned replica's calls: its metrics name it.
        replica = replica or live.replica
        if self.max_rollout_calls and live.refusals >= self.max_rollout_calls:
            # Its ledger says so already, 10,000 times by default: the rest are counted only.
            self._report(
                CallReport(
                    rollout_id, None, CallStatus.REJECTED, "rollout_call_quota", replica=replica
                )
            )
            raise TooManyRequests(
                f"rollout {rollout_id} has had {live.refusals} calls refused: its quota "
                f"(--max-rollout-calls {self.max_rollout_calls}) is spent, and further refusals "
                f"are not recorded one by one ({reason}: {message})",
                code="rollout_call_quota",
            )
        live.refusals += 1
        if not self.refusal_folds.take(rollout_id):
            # Past the rollout's rate of ledger rows: one entry will stand for this one and
            # the others of its second (`core.refusal_folds`); metrics still count each.
            call_id = self.refusal_folds.join(live, reason, message, http_status)
            self._report(
                CallReport(rollout_id, call_id, CallStatus.REJECTED, reason, replica=replica)
            )
            return call_id
        call_id = new_call_id()
        seq = live.take_seq()
        entry = LedgerEntry(
            rollout_id,
            call_id,
            seq,
            CallStatus.REJECTED,
            reason,
            message,
            http_status,
            int(time.time() * 1000),
        )
        live.outcomes[call_id] = CallOutcome(
            seq,
            call_id,
            CallStatus.REJECTED,
            reason=reason,
            http_status=http_status,
            message=message,
        )
        self._report(CallReport(rollout_id, call_id, CallStatus.REJECTED, reason, replica=replica))
        # Held "in flight" until its entry is written: a rollout created by this refusal (an id
        # never seen) may leave memory under the live-rollout cap only once the store has the
        # entry, or a resumed copy would hand its sequence number out again.
        live.enter()
        try:
            await self.ledger.write(entry)
        finally:
            live.leave()
        return call_id

    async def refuse(self, rollout_id: str, err: ProxyError, *, replica: str = "") -> str | None:
        """Record a call refused with `err` before admission; returns its call id. A 409 (the
        rollout is sealed: its ledger is closed) is reported but not written. `replica` is the
        upstream replica the call was for ("" for none), reported with the outcome."""
        if err.status == 409 or err.code in RESUME_REFUSALS:
            # A sealed rollout's ledger is closed; one not read from the store in time has no
            # seq to write at (the read goes on): both counted, neither written.
            self._report(
                CallReport(rollout_id, None, CallStatus.REJECTED, err.code, replica=replica)
            )
            return None
        return await self.reject(rollout_id, err.code, err.message, err.status, replica=replica)

    async def _record_not_staged(
        self,
        call: Call,
        status: CallStatus,
        reason: str,
        message: str,
        http_status: int | None,
        *,
        attachments: int = 0,
        stage_seconds: float | None = None,
    ) -> None:
        if status is CallStatus.CAPTURE_FAILED:
            call.rollout.poisoned = True
        call.rollout.outcomes[call.call_id] = CallOutcome(
            call.seq,
            call.call_id,
            status,
            reason=reason,
            http_status=http_status,
            message=message,
            retry_of=call.retry_of,
        )
        self._report(
            CallReport(
                call.rollout_id,
                call.call_id,
                status,
                reason,
                attachments=attachments,
                stage_seconds=stage_seconds,
                replica=call.replica,
            )
        )
        entry = LedgerEntry(
            call.rollout_id,
            call.call_id,
            call.seq,
            status,
            reason,
            message,
            http_status,
            int(time.time() * 1000),
        )
        await self.ledger.write(entry)

    def _report(self, report: CallReport) -> None:
        for subscriber in self.on_outcome:
            subscriber(report)

    async def drain(self, wait_s: float) -> None:
        """Wait for late staging and ledger writes (shutdown), up to `wait_s` seconds each."""
        await self.stager.drain(wait_s)
        await self.refusal_folds.flush()
        await self.ledger.drain(wait_s)

    @property
    def pending_stages(self) -> int:
        return self.stager.pending

    @property
    def sink_failing(self) -> str | None:
        return self.stager.sink_failing
