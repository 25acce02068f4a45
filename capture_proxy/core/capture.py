"""The capture core: everything that turns one model call into a staged record, without HTTP.

`Capture` admits calls (sequence numbers, retries, weight version), builds and seals their
records, stages them through the `Stager` and keeps the ledger of calls that were not staged. The
flow of one call around it (decode, upstream, relay) is `capture_proxy.core.exchange.Exchange`;
every outcome is reported once to the `Capture.on_outcome` subscribers (the proxy's metrics).

This module holds the object, its state, the weight version and the weight-update pause; the rest
is one module per concern, each bound here as `Capture` methods: `core/held_rollouts.py` (the
rollouts held in memory, resumed from the store, released), `core/lifecycle.py` (creation, seal,
outcomes), `core/admission.py` (a new call's checks, seq and claim), `core/completion.py` (a
completed call's record built, sealed and staged) and `core/not_staged.py` (calls failed or
refused, into the ledger).

Policy written into the code: a call is either staged exactly, or recorded in its rollout's ledger
as not staged (with why) — crash visibly instead of letting a call through unrecorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable

from ..errors import CaptureUnavailable, Unprocessable
from ..schemas.digest import RequestValueCache
from ..schemas.message_memo import MessageMemo
from ..sinks.base import ReadsRolloutsAhead, StagingSink, StagingSource
from . import admission, completion, held_rollouts, lifecycle, not_staged
from .call import SAMPLING_KEYS, Call, CallReport, CompletionLike, sampling_of
from .handback import Handback
from .ledger import LedgerWriter
from .outcomes import HeaderLocks
from .policy import RequestPolicy
from .refusal_folds import RefusalFolds
from .resumes import Resumes
from .rollouts import RolloutLive
from .staging import Stager
from .weights import state_header, stored_weight_version

__all__ = ["SAMPLING_KEYS", "Call", "CallReport", "Capture", "CompletionLike", "sampling_of"]

log = logging.getLogger("capture_proxy.capture")


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
        prepare = sink.prepare_rollout if isinstance(sink, ReadsRolloutsAhead) else None
        self.resumes = (
            Resumes(source, resume_timeout, self._take_resumed, prepare)
            if source is not None
            else None
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

    # -- the rest, one module per concern, bound here as methods -------------------------------

    # The rollouts held in memory, resumed from the store, released (`core/held_rollouts.py`).
    rollout = held_rollouts.rollout
    _sealed_placeholder = held_rollouts.sealed_placeholder
    ensure_rollout = held_rollouts.ensure_rollout
    find_rollout = held_rollouts.find_rollout
    _take_resumed = held_rollouts.take_resumed
    evict_idle = held_rollouts.evict_idle
    remember_sealed = held_rollouts.remember_sealed
    _store_caught_up = held_rollouts.store_caught_up
    _evict = held_rollouts.evict
    _forget_messages = held_rollouts.forget_messages

    # Creation, seal and outcomes (`core/lifecycle.py`).
    create_rollout = lifecycle.create_rollout
    _header = lifecycle.header
    seal = lifecycle.seal
    _seal_event_missing = lifecycle.seal_event_missing
    put_outcome = lifecycle.put_outcome

    # A new call's checks, seq, claim and end (`core/admission.py`).
    check_admission = admission.check_admission
    check_rollout_inflight = admission.check_rollout_inflight
    _check_quotas = admission.check_quotas
    begin_call = admission.begin_call
    begin_call_offloaded = admission.begin_call_offloaded
    start_claim = admission.start_claim
    _finish = admission.finish

    # A completed call's record built, sealed and staged (`core/completion.py`).
    prepare_record = completion.prepare_record
    build_record = completion.build_record
    complete_call = completion.complete_call
    _stage_once = completion.stage_once
    _claim_refusal = completion.claim_refusal
    _staged_unclaimed = completion.staged_unclaimed
    _forget_stale = completion.forget_stale

    # Calls failed or refused: the ledger (`core/not_staged.py`).
    fail_call = not_staged.fail_call
    reject = not_staged.reject
    refuse = not_staged.refuse
    _record_not_staged = not_staged.record_not_staged
    _report = not_staged.report

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
