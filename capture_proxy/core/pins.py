"""A rollout's replica pin: which upstream replica its calls go to, kept in its event log.

With several upstream replicas (`capture_proxy.core.transport.ReplicaRouter`), a rollout's calls
all go to one replica, where its prefix cache lives. The pin is written as a ``replica`` event
(body: ``replica``, and ``moved_from`` when the rollout leaves another replica), so a proxy that
restarts, or resumes the rollout after it left memory, keeps sending it to the same replica
(`capture_proxy.core.rollouts.pinned_replica`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..schemas.events import EventDraft, EventKind, RolloutEvent
from ..sinks.base import StagingSink
from .rollouts import RolloutLive

__all__ = ["pin", "pin_event", "write_pin"]

log = logging.getLogger("capture_proxy.replicas")


def pin_event(rollout_id: str, replica: str, moved_from: str = "") -> EventDraft:
    """The ``replica`` event pinning `rollout_id` to `replica` (moved from `moved_from`)."""
    body: dict[str, Any] = {"replica": replica}
    if moved_from:
        body["moved_from"] = moved_from
    return EventDraft(rollout_id, EventKind.REPLICA, int(time.time() * 1000), body=body)


def pin(live: RolloutLive, replica: str) -> EventDraft:
    """Pin `live` to `replica` now (synchronously: the rollout's next call sees it) and return
    the ``replica`` event to write. A move from another replica is logged as a warning."""
    moved_from, live.replica = live.replica, replica
    if moved_from:
        log.warning(
            "rollout %s moved from replica %s to %s (its replica is unhealthy)",
            live.rollout_id,
            moved_from,
            replica,
            extra={"rollout_id": live.rollout_id},
        )
    return pin_event(live.rollout_id, replica, moved_from)


async def write_pin(sink: StagingSink, event: EventDraft) -> RolloutEvent | None:
    """Write a pin's event. A write that fails is logged: the rollout stays pinned in this
    process, and a later resume picks a replica again (a move, seen in its records)."""
    try:
        return await sink.append_event(event)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # any sink failure: the pin is kept in memory, said here
        log.warning(
            "rollout %s: writing its replica pin (%s) failed: %s: %s",
            event.rollout_id,
            event.body.get("replica"),
            type(e).__name__,
            e,
            extra={"rollout_id": event.rollout_id},
        )
        return None
