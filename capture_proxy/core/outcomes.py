"""Rollout outcomes as the proxy writes them: one header write at a time per rollout.

An outcome lives in its rollout's header (`RolloutInfo.outcome_history`, see
`capture_proxy.schemas.outcome`), and a header write replaces the whole header. So every write of
one rollout's header — its creation, its seal, each outcome — goes through `HeaderLocks`: two
outcomes sent at once both land in the history, and an outcome written while the seal waits for
in-flight calls cannot write the header back as open after the seal, nor as sealed before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from ..errors import Conflict, Unprocessable
from ..schemas.outcome import RESERVED_METADATA_PREFIX, RolloutOutcome

__all__ = [
    "MAX_OUTCOMES",
    "MAX_OUTCOME_BYTES",
    "HeaderLocks",
    "check_driver_metadata",
    "with_outcome",
]

#: The largest outcome body taken (bytes): an outcome is a few numbers, a group and a note,
#: and it is rewritten with its rollout's header at every later write.
MAX_OUTCOME_BYTES = 64 * 1024
#: Outcomes kept per rollout. Each is rewritten with the header at every later write, so the
#: history is bounded; a judge that needs more revisions is grading something else.
MAX_OUTCOMES = 100


@dataclass(slots=True)
class _Lock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class HeaderLocks:
    """One `asyncio.Lock` per rollout id, held only while some task wants it (memory is bounded
    by the headers being written, not by every rollout ever seen)."""

    def __init__(self) -> None:
        self._locks: dict[str, _Lock] = {}

    @asynccontextmanager
    async def hold(self, rollout_id: str) -> AsyncIterator[None]:
        entry = self._locks.setdefault(rollout_id, _Lock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[rollout_id]


def with_outcome(
    rollout_id: str, history: tuple[RolloutOutcome, ...], outcome: RolloutOutcome
) -> tuple[RolloutOutcome, ...]:
    """`history` with `outcome` appended; 409 ``outcome_history_full`` past `MAX_OUTCOMES`."""
    if len(history) >= MAX_OUTCOMES:
        raise Conflict(
            f"rollout {rollout_id} already has {len(history)} outcomes, the most kept: "
            "nothing was changed",
            code="outcome_history_full",
        )
    return (*history, outcome)


def check_driver_metadata(metadata: dict[str, object]) -> None:
    """Refuse metadata keys the proxy keeps for itself (422 naming the key)."""
    for key in metadata:
        if key.startswith(RESERVED_METADATA_PREFIX):
            raise Unprocessable(
                f"Invalid key `{key}` at metadata.{key}; keys starting with "
                f"`{RESERVED_METADATA_PREFIX}` are the proxy's own",
                code="reserved_metadata_key",
                param=f"metadata.{key}",
            )
