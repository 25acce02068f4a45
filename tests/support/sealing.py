"""Sealing a rollout in a test store the way the proxy does, so verified reads take it.

The proxy writes a sealed header and then the ``seal`` event, and for every outcome the header
and then an ``outcome`` event (`capture_proxy.core.capture.Capture`): a verified read holds the
header to the chain (`capture_proxy.read.integrity`), so a header written alone reads as edited.
"""

from __future__ import annotations

from collections.abc import Mapping

from capture_proxy.schemas.events import EventDraft, EventKind
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.base import StagingSink

__all__ = ["put_header", "put_sealed"]


async def put_sealed(sink: StagingSink, info: RolloutInfo) -> None:
    """Write `info` (a sealed header, with any outcomes) and the events the proxy writes with it."""
    assert info.state is RolloutState.SEALED
    await put_header(sink, info)


async def put_header(sink: StagingSink, info: RolloutInfo) -> None:
    """Write `info` (open or sealed, with any outcomes) and the events the proxy writes with it:
    the ``seal`` event when it is sealed, an ``outcome`` event per outcome."""
    await sink.put_rollout(info)
    if info.state is RolloutState.SEALED:
        at_ms = info.sealed_at_ms or 0
        await sink.append_event(EventDraft(info.rollout_id, EventKind.SEAL, at_ms))
    for revision, outcome in enumerate(info.outcome_history, 1):
        reward = outcome.reward
        body = {
            "reward": dict(reward) if isinstance(reward, Mapping) else reward,
            "group_id": outcome.group_id,
            "revision": revision,
        }
        await sink.append_event(
            EventDraft(info.rollout_id, EventKind.OUTCOME, outcome.at_ms, body=body)
        )
