"""Admitting a call: the checks a new call passes (seal, quotas, pause, back-pressure, limits),
its sequence number, retry link and weight version, its claim of the seq, and its end.

Bound as `Capture` methods.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import CaptureUnavailable, Conflict, TooManyRequests
from ..schemas.events import RolloutEvent, claim_event
from ..schemas.records import Attachment
from .call import Call, log_claim
from .experts import ExpertsPlan
from .ids import new_call_id
from .rollouts import CallOutcome, RolloutLive, request_identity, request_key

__all__ = [
    "begin_call",
    "begin_call_offloaded",
    "check_admission",
    "check_quotas",
    "check_rollout_inflight",
    "finish",
    "start_claim",
]

if TYPE_CHECKING:
    from .capture import Capture

log = logging.getLogger("capture_proxy.capture")


def check_admission(cap: Capture, live: RolloutLive, size: int = 0) -> None:
    """Raise the error a new call of this rollout gets now, if any (nothing forwarded yet).

    `size` is the call's body size, reserved against the byte quota while it is in flight.
    """
    if live.sealed:
        raise Conflict(f"rollout {live.rollout_id} is sealed", code="rollout_sealed")
    cap._check_quotas(live, size)
    if cap.paused:  # paused after `hold_while_paused` let it through (an offloaded call)
        raise cap._paused_error()
    if cap.unavailable_reason is not None:
        raise CaptureUnavailable(
            f"not accepting calls: {cap.unavailable_reason}",
            code="capture_unavailable",
            headers={"Retry-After": "5"},
        )
    if cap.stager.full:
        raise CaptureUnavailable(
            f"{cap.stager.pending} staging writes pending (limit {cap.stager.max_pending})",
            code="staging_backlog",
            headers={"Retry-After": "1"},
        )
    if cap.max_inflight and cap.inflight >= cap.max_inflight:
        raise TooManyRequests(
            f"{cap.inflight} calls in flight (limit {cap.max_inflight})",
            code="too_many_inflight",
            headers={"Retry-After": "1"},
        )
    check_rollout_inflight(cap, live)


def check_rollout_inflight(cap: Capture, live: RolloutLive) -> None:
    """429 ``too_many_inflight_rollout`` for a rollout holding ``--max-inflight-per-rollout``
    calls in flight. Checked at admission, and by the server from a call's head too, before
    its body is read and decoded: a sandbox flooding its rollout with calls is then refused
    for the price of a request head."""
    if cap.max_inflight_per_rollout and live.in_flight >= cap.max_inflight_per_rollout:
        raise TooManyRequests(
            f"rollout {live.rollout_id} has {live.in_flight} calls in flight "
            f"(limit {cap.max_inflight_per_rollout})",
            code="too_many_inflight_rollout",
            headers={"Retry-After": "1"},
        )


def check_quotas(cap: Capture, live: RolloutLive, size: int) -> None:
    # 429, not 403 or 413: the rollout used up its allowance (as an API answers a spent
    # quota); the request itself is fine. No Retry-After: waiting frees nothing. Clients
    # that retry 429s (the OpenAI SDKs, OpenCode) give up after a few tries.
    if cap.max_rollout_calls and live.calls_used >= cap.max_rollout_calls:
        raise TooManyRequests(
            f"rollout {live.rollout_id} has made {live.calls_used} calls: its call quota "
            f"(--max-rollout-calls {cap.max_rollout_calls}) is spent",
            code="rollout_call_quota",
        )
    used = live.bytes_staged + live.bytes_reserved
    limit = cap.max_rollout_bytes
    if limit and (used >= limit or used + size > limit):
        raise TooManyRequests(
            f"rollout {live.rollout_id} has staged {used} bytes (with calls in flight); "
            f"a call of {size} more would pass its byte quota "
            f"(--max-rollout-bytes {limit})",
            code="rollout_byte_quota",
        )


def begin_call(
    cap: Capture,
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
    live = cap.rollout(rollout_id)
    if live is None:
        # Released from memory since it was resolved (idle or over the live-rollout cap):
        # only the store knows its next sequence number now, so never start it afresh.
        raise CaptureUnavailable(
            f"rollout {rollout_id} is not loaded: resolve it (ensure_rollout) and retry",
            code="rollout_not_loaded",
            headers={"Retry-After": "0"},
        )
    cap.check_admission(live, size)
    request_size = None
    if key is None:
        key, request_size = request_identity(request)
    previous, live.last_weight_version = live.last_weight_version, cap.weight_version
    decreased = previous if previous is not None and cap.weight_version < previous else None
    if decreased is not None:
        log.warning(
            "rollout %s: call stamped weight version %d after %d (flagged in its record)",
            rollout_id,
            cap.weight_version,
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
        weight_version=cap.weight_version,
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
    cap.inflight += 1
    call.task = asyncio.current_task()
    cap.calls[call.call_id] = call
    cap._idle.clear()
    call.claim = cap.start_claim(call)
    return call


async def begin_call_offloaded(
    cap: Capture,
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
    live = cap.rollout(rollout_id)
    index = live.experts if live is not None else None

    # The experts lookup only reads the index: a call staged meanwhile is not a candidate
    # for this one, which then asks for more positions than it needed, never fewer.
    def keys() -> tuple[bytes, ExpertsPlan | None]:
        return request_key(request), index.plan(request) if index is not None else None

    key, experts = await asyncio.to_thread(keys)
    call = cap.begin_call(rollout_id, request, attachments, key=key, size=size, experts=experts)
    call.offload = True
    return call


def start_claim(cap: Capture, call: Call) -> asyncio.Future[RolloutEvent]:
    draft = claim_event(call.rollout_id, call.seq, call.call_id, call.admitted_ms)
    task = asyncio.ensure_future(cap.sink.append_event(draft))
    task.add_done_callback(functools.partial(log_claim, call))
    return task


def finish(cap: Capture, call: Call) -> None:
    if not call.finished:
        call.finished = True
        call.rollout.bytes_reserved -= call.reserved
        call.rollout.leave()
        cap.inflight -= 1
        cap.calls.pop(call.call_id, None)
        if not cap.calls:
            cap._idle.set()
