"""Staging a completed call: its record built and sealed, staged through the `Stager` after its
claim, moved to the next free seq when another proxy continued its rollout (`core/handback.py`).

Bound as `Capture` methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..schemas.digest import EncodingError, encode_request, seal_record
from ..schemas.message_memo import rollout_digester
from ..schemas.records import (
    LOGPROBS_MODE_UNKNOWN,
    CallStatus,
    RecordValidationError,
    StagedCallRecord,
    StageResult,
)
from ..schemas.tokens import full_sequence
from ..sinks.base import DuplicateSeq
from .call import Call, CallReport, CompletionLike, sampling_of
from .experts import record_experts
from .handback import MAX_RESEQ
from .rollouts import CallOutcome, record_bytes
from .weights import DECREASED_FROM

__all__ = [
    "build_record",
    "claim_refusal",
    "complete_call",
    "forget_stale",
    "prepare_record",
    "stage_once",
    "staged_unclaimed",
]

if TYPE_CHECKING:
    from .capture import Capture

log = logging.getLogger("capture_proxy.capture")


def prepare_record(cap: Capture, call: Call) -> None:
    """Compute what the call's record needs from its request alone (the request's part of
    the digest), so that sealing it once the answer is in costs less; the exchange calls
    this while the upstream generates. A request that cannot be encoded is left for
    `build_record`, which refuses it (``invalid_record``) when the call is staged."""
    if call.request_part is not None or call.staging or call.finished:
        return
    with contextlib.suppress(EncodingError):
        call.request_part = encode_request(
            call.request,
            digester=rollout_digester(cap._message_digests, call.rollout_id),
            encoder=cap._request_values,
        )


def build_record(
    cap: Capture,
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
        effective_sampling=(dict(effective_sampling) if effective_sampling is not None else None),
        engine_weight_version=engine_weight_version,
        weight_spans=weight_spans,
        token_in=token_in,
        bridge_spans=bridge_spans,
        replica=call.replica,
    )
    sealed = seal_record(
        record,
        attachments=call.attachments,
        encoder=cap._request_values,
        digester=rollout_digester(cap._message_digests, call.rollout_id),
        request_part=call.request_part,
    )
    call.record_bytes = record_bytes(
        sealed, call.attachments.values(), request_size=call.request_size
    )
    return sealed


async def complete_call(
    cap: Capture,
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
            cap.build_record,
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
        result, landed = await cap._stage_once(call, build)
        # Its seq is another call's: another proxy continued the rollout while this one
        # held it (core/handback.py). Read it again and stage the call at the next free
        # seq, unless its record landed already (then marked orphaned: capture_failed).
        for _ in range(MAX_RESEQ):
            if landed or result.reason != "duplicate_seq":
                break
            if not await cap.handback.to_next_free_seq(call):
                break
            result, landed = await cap._stage_once(call, build)
        if result.reason == "duplicate_seq":
            cap._forget_stale(call)
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
            cap._report(
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
            await cap._record_not_staged(
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
        cap._finish(call)


async def stage_once(
    cap: Capture, call: Call, build: Callable[[], StagedCallRecord]
) -> tuple[StageResult, bool]:
    """Build and stage the call's record at its seq: the result, and whether the record
    landed in the store (staged, or staged and then refused for its claim: orphaned)."""
    # A claim that already failed: nothing to stage. One still on its way does not hold
    # the call up: the record queues behind it (and is checked against it below).
    refused = cap._claim_refusal(call)
    if refused is not None:
        return refused, False
    try:
        record = await asyncio.to_thread(build) if call.offload else build()
    except (RecordValidationError, EncodingError) as e:
        return StageResult.failed("invalid_record", str(e)), False
    result = await cap.stager.stage(record, call.attachments)
    if result.status is CallStatus.STAGED:
        return await cap._staged_unclaimed(call) or result, True
    return result, False


def claim_refusal(cap: Capture, call: Call) -> StageResult | None:
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
    cap.stager.sink_failing = f"{type(error).__name__}: {error}"
    return StageResult.failed(
        "sink_error", f"claiming seq {call.seq} failed: {type(error).__name__}: {error}"
    )


async def staged_unclaimed(cap: Capture, call: Call) -> StageResult | None:
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
            await asyncio.wait_for(asyncio.shield(claim), cap.stager.timeout)
    refused = cap._claim_refusal(call)
    if refused is None and not claim.done():
        refused = StageResult.failed(
            "stage_timeout",
            f"the store took longer than {cap.stager.timeout:g}s to claim seq {call.seq}",
        )
    if refused is not None:
        try:
            await cap.sink.mark_orphaned(call.call_id, refused.reason or "sink_error")
        except Exception as e:  # the capture_failed ledger entry still says what happened
            log.error("could not mark %s orphaned: %s", call.call_id, e)
    return refused


def forget_stale(cap: Capture, call: Call) -> None:
    """Another call holds this call's seq: another proxy continued the rollout while this
    one held it (a handoff, then this proxy came back). What is held here is stale: the
    rollout's next call resumes it from the store, after the highest claimed seq. (Without
    a store to read, memory is all there is: the copy stays, poisoned.)"""
    if cap.source is not None and cap.rollouts.get(call.rollout_id) is call.rollout:
        del cap.rollouts[call.rollout_id]
        log.warning(
            "rollout %s: seq %d is held by another call (another proxy continued it); "
            "its next call resumes it from the store",
            call.rollout_id,
            call.seq,
        )
