"""A rollout's lifecycle as the driver drives it: creation, seal and outcomes.

Each writes the rollout's event first, then its header (under the header lock), so a verified
read always finds the event its header names. Bound as `Capture` methods.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import CaptureUnavailable, Conflict, Unprocessable
from ..schemas.events import EventDraft, EventKind, token_in_event
from ..schemas.outcome import RolloutOutcome
from ..schemas.records import RolloutInfo, RolloutState
from .outcomes import check_driver_metadata, with_outcome
from .policy import PolicyError, check_policy
from .rollouts import KEY_HASH_FIELD, RolloutLive, resume_rollout

__all__ = ["create_rollout", "header", "put_outcome", "seal", "seal_event_missing"]

if TYPE_CHECKING:
    from .capture import Capture

log = logging.getLogger("capture_proxy.capture")


async def create_rollout(
    cap: Capture,
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
    if await cap.find_rollout(rollout_id) is not None:
        raise Conflict(f"rollout {rollout_id} already exists", code="rollout_exists")
    live = RolloutLive(rollout_id, created_at_ms=int(time.time() * 1000))
    live.key_sha256 = hashlib.sha256(key.encode()).hexdigest() if key is not None else None
    live.policy = checked
    live.metadata = dict(metadata or {})
    live.token_in = token_in
    cap._evict()
    cap.rollouts[rollout_id] = live  # no await since the lookup: nobody registered it since
    async with cap._headers.hold(rollout_id):
        await cap.sink.put_rollout(cap._header(live))
    if token_in is not None:
        at_ms = int(time.time() * 1000)
        await cap.sink.append_event(token_in_event(rollout_id, token_in, at_ms))
    return live


def header(cap: Capture, live: RolloutLive) -> RolloutInfo:
    """The header to store for a live rollout (sealed once its seal is written)."""
    return RolloutInfo(
        live.rollout_id,
        RolloutState.OPEN if live.sealed_at_ms is None else RolloutState.SEALED,
        live.poisoned,
        live.created_at_ms,
        live.sealed_at_ms,
        {**live.metadata, KEY_HASH_FIELD: live.key_sha256} if live.key_sha256 else live.metadata,
        live.policy,
        live.outcome_history,
    )


async def seal(cap: Capture, rollout_id: str, wait_s: float) -> RolloutLive:
    """Refuse new calls for the rollout, wait for its in-flight calls (up to `wait_s`)."""
    live = await cap.find_rollout(rollout_id)
    if live is None:
        raise KeyError(rollout_id)
    if live.sealed and cap.rollouts.get(rollout_id) is not live:
        # Sealed earlier and released from memory: nothing to wait for or write (writing
        # this copy's header could replace the stored one); answer the stored rollout.
        if cap.source is not None:
            stored = await asyncio.to_thread(resume_rollout, cap.source, rollout_id)
            if stored is not None:
                await cap._seal_event_missing(rollout_id)
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
    async with cap._headers.hold(rollout_id):
        live.sealed_at_ms = int(time.time() * 1000)
        # The seal event first, then the header: readers list a rollout as sealed by its
        # header (the rollout index, batches), and a verified read holds a sealed header to
        # a seal event, which is then always there already. A stop between the two leaves a
        # rollout sealed in its log and open in its header: not read as sealed, and sealed
        # again (event and header) by the driver's retry.
        if newly_sealed:
            await cap.sink.append_event(EventDraft(rollout_id, EventKind.SEAL, live.sealed_at_ms))
        else:  # a seal sent again, perhaps after one whose event could not be written
            await cap._seal_event_missing(rollout_id)
        await cap.sink.put_rollout(cap._header(live))
    if live.in_flight == 0 and cap.rollouts.get(rollout_id) is live:
        # A sealed rollout takes no more calls: memory holds live work only (its id, for
        # the 409s). A manifest request reads it from the store.
        del cap.rollouts[rollout_id]
        cap.remember_sealed(live)
        cap._forget_messages(rollout_id)
    return live


async def seal_event_missing(cap: Capture, rollout_id: str) -> None:
    """Write the seal event of a rollout whose header says sealed and whose event log does
    not: the proxy stopped between the two writes of a seal. Verified reads hold the header
    to the chain, so the driver's seal sent again completes it."""
    open_source = cap.source
    if open_source is None:
        return
    events = await asyncio.to_thread(lambda: open_source().events(rollout_id))
    if events and not any(e.kind == EventKind.SEAL for e in events):
        log.warning(
            "rollout %s: sealed in its header only; its seal event is written now", rollout_id
        )
        await cap.sink.append_event(EventDraft(rollout_id, EventKind.SEAL, int(time.time() * 1000)))


async def put_outcome(cap: Capture, rollout_id: str, outcome: RolloutOutcome) -> RolloutInfo:
    """Store `outcome` as the rollout's latest, open or sealed; returns the header written.

    The history keeps every earlier outcome. Raises KeyError for a rollout neither this
    process nor the store knows, `Conflict` (409) past `MAX_OUTCOMES`, and
    `CaptureUnavailable` (503) when the store cannot take it: then nothing changed.
    """
    async with cap._headers.hold(rollout_id):
        live = await cap.find_rollout(rollout_id)
        if live is None:
            raise KeyError(rollout_id)
        held = cap.rollouts.get(rollout_id) is live
        if held:
            history = with_outcome(rollout_id, live.outcome_history, outcome)
            header = replace(cap._header(live), outcome_history=history)
        else:
            # Sealed and released from memory: the stored header is the whole truth
            # (its seal time, metadata and outcomes), and is written back as it is.
            open_source = cap.source
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
            await cap.sink.append_event(
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
            await cap.sink.put_rollout(header)
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
