"""The store head of a Parquet dataset in a local folder, claim files included.

A claim is durable as its file (`_claims`) before its ``claim`` event commits (the event waits
for the next unit, `_writer`): a proxy killed then leaves the file alone. So the store head
covers each rollout's claim files as well as its chain (`schemas.store_head.ClaimCount`: how
many and the highest seq), and the writer moves it as soon as a claim file is durable, not when
the event commits: the head it publishes is the store's at every point a crash can stop it.

`ClaimedHead` holds the claim counts of the rollouts in use (a rollout's is read from its
claims folder when not held: one listing), tells the keeper of each claim created, and gives it
the counts as units commit. Writer thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ...schemas.store_head import ClaimCount
from ..store_head import StoreHeadKeeper
from ._claims import SeqClaim, claim_seqs
from ._fs import DatasetFS

__all__ = ["ClaimedHead"]

log = logging.getLogger(__name__)

#: Rollouts whose claim counts are held (a tuple each); a sealed rollout's go when its seal
#: commits, the least recently used beyond this.
_COUNTS_KEPT = 65_536


class ClaimedHead:
    """Keeps `keeper` (the dataset's store head) up to date with the claim files and the
    committed events. `committed_head` gives a rollout's last committed event."""

    def __init__(
        self,
        dfs: DatasetFS,
        keeper: StoreHeadKeeper,
        committed_head: Callable[[str], tuple[int, str] | None],
    ) -> None:
        self._dfs = dfs
        self.keeper = keeper
        self._committed_head = committed_head
        self._counts: OrderedDict[str, ClaimCount | None] = OrderedDict()

    def created(self, claims: list[SeqClaim]) -> None:
        """Claim files were created and are durable (`_claims.Holders`). Never raises: the
        claims stand whatever becomes of the head's bookkeeping (a failure is logged: the head
        published until the writer opens the store again then misses them)."""
        try:
            self._created(claims)
        except Exception:
            log.exception(
                "%s: the store head could not take in %d new claim file(s); until the store is "
                "opened again the published head will not match it",
                self.keeper.name,
                len(claims),
            )

    def _created(self, claims: list[SeqClaim]) -> None:
        seqs: dict[str, list[int]] = {}
        for claim in claims:
            seqs.setdefault(claim.rollout_id, []).append(claim.seq)
        changes = []
        for rollout_id, new in seqs.items():
            before = self._held(rollout_id, new)
            after = (before or ClaimCount(0, -1)).plus(new)
            self._hold(rollout_id, after)
            head = self._committed_head(rollout_id)
            changes.append((rollout_id, "" if head is None else head[1], before, after))
        self.keeper.claimed(changes)

    def committed(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """A unit committed with these ledger rows: its events move their rollouts' heads."""
        self.keeper.committed(
            ((r["rollout_id"], r["prev_hash"], r["hash"]) for r in rows if r["kind"] == "event"),
            self.count,
        )

    def count(self, rollout_id: str) -> ClaimCount | None:
        """The rollout's claim files as the store holds them now."""
        return self._held(rollout_id, ())

    def forget(self, rollout_id: str) -> None:
        """Drop what is held of a rollout that takes no more calls (sealed)."""
        self._counts.pop(rollout_id, None)

    def _held(self, rollout_id: str, new: Iterable[int]) -> ClaimCount | None:
        """The rollout's claim files before the claims of `new` (just created) were."""
        if rollout_id in self._counts:
            self._counts.move_to_end(rollout_id)
            return self._counts[rollout_id]
        skip = set(new)
        count = ClaimCount.of(s for s in claim_seqs(self._dfs, rollout_id) if s not in skip)
        self._hold(rollout_id, count)
        return count

    def _hold(self, rollout_id: str, count: ClaimCount | None) -> None:
        self._counts[rollout_id] = count
        self._counts.move_to_end(rollout_id)
        if len(self._counts) > _COUNTS_KEPT:
            self._counts.popitem(last=False)
