"""A writer's store head, kept up to date with its commits and published outside the store.

The writer thread hands each committed batch's events to `StoreHeadKeeper.committed`; the
keeper advances the state (`schemas.store_head`: O(1) per rollout the batch touched) and takes
a snapshot `current` reads from any thread (``/metrics``: ``capture_proxy_store_head_info``). It
logs one structured line (logger ``capture_proxy.store_head``, field ``store_head``) at most once
a second while commits come, and one when the writer closes: the head an operator keeps.

A Parquet dataset's claim files enter the head as soon as they are durable (`claimed`), before
their ``claim`` events commit: the head a writer publishes is then the store's at every moment a
crash can leave it in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from ..schemas.store_head import ClaimCount, StoreHead, StoreHeadState

__all__ = ["LOG_EVERY_S", "StoreHeadKeeper"]

log = logging.getLogger("capture_proxy.store_head")

#: At most one log line per this many seconds while commits come (a batch commits every few
#: milliseconds under load: a line per batch would be most of the log).
LOG_EVERY_S = 1.0


class StoreHeadKeeper:
    """The store head of the store `name` as its one writer commits. `committed` runs on the
    writer thread only; `current` from anywhere."""

    def __init__(self, name: str, state: StoreHeadState, *, log_every_s: float = LOG_EVERY_S):
        self.name = name
        self._state = state
        self._every = log_every_s
        self._current = state.head()
        self._logged: StoreHead | None = None
        self._last_log = 0.0
        self._log(self._current, "at open")

    def current(self) -> StoreHead:
        return self._current

    def committed(
        self,
        events: Iterable[tuple[str, str, str]],
        claims: Callable[[str], ClaimCount | None] = lambda _: None,
    ) -> None:
        """Advance past a committed batch's events, ``(rollout id, prev_hash, hash)`` in commit
        order. Events of one rollout telescope: only its heads before and after are hashed.
        `claims` gives a rollout's claim files (Parquet; they do not change with a commit)."""
        span: dict[str, list[str]] = {}
        count = 0
        for rollout_id, prev_hash, new_hash in events:
            count += 1
            seen = span.get(rollout_id)
            if seen is None:
                span[rollout_id] = [prev_hash, new_hash]
            else:
                seen[1] = new_hash
        if not count:
            return
        state = self._state
        for rollout_id, (before, after) in span.items():
            state.advance(rollout_id, before, after, claims(rollout_id))
        state.events += count - len(span)
        self._moved("after a commit")

    def claimed(self, changes: Iterable[tuple[str, str, ClaimCount | None, ClaimCount]]) -> None:
        """Claim files were created (durable): ``(rollout id, its committed chain head or "",
        its claim files before, after)`` for each rollout they belong to."""
        state = self._state
        moved = False
        for rollout_id, head, before, after in changes:
            state.move(rollout_id, (head, before), (head, after))
            moved = True
        if moved:
            self._moved("after a claim")

    def _moved(self, when: str) -> None:
        self._current = head = self._state.head()
        now = time.monotonic()
        if now - self._last_log >= self._every:
            self._log(head, when)

    def close(self) -> None:
        """Log the head the writer leaves the store at (the one to keep)."""
        if self._current != self._logged:
            self._log(self._current, "at close")

    def _log(self, head: StoreHead, when: str) -> None:
        self._last_log = time.monotonic()
        self._logged = head
        log.info(
            "%s: store head %s (head:rollouts:events) %s",
            self.name,
            head.token(),
            when,
            extra={"store_head": {**head.as_dict(), "store": self.name}},
        )
