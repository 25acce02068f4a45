"""The trainer-facing reader: `open_store(url)`.

    >>> from capture_proxy import open_store
    >>> store = open_store("sqlite:///capture.db")
    >>> for traj in store.iter_trajectories():           # sealed, not poisoned, verified
    ...     traj.token_ids, traj.loss_mask, traj.logprobs
    >>> records = store.fetch(manifest_coords)           # verifies every digest; raises on mismatch
    >>> store.verify()                                   # raises on any corruption in the store
    >>> remote = open_store("http://proxy-host:8100", token=reader_token)  # the same API

The trainer-facing reads (`calls`, `trajectory`, `iter_trajectories`) take the same three
keywords, with safe defaults: ``include_open=False`` (leave out rollouts not sealed yet),
``include_poisoned=False`` (leave out rollouts with a call answered but not staged, see
`capture_proxy.read.status`) and ``verify=True`` (leave out rollouts that do not verify: every
record's digest recomputed, the event log's chain, its accounting of every record and ledger
entry and the header against it, `capture_proxy.read.integrity`; ``verify=False`` skips the
checks, for data already verified, and reads such rollouts as they are). The iterator skips
what the filters leave out; `calls` and `trajectory`, asked for one rollout by name, raise
`RolloutExcluded` (`RolloutUnverified` for ``verify``) naming the keyword to pass. `fetch` and
`verify` always check.

`Store` is defined here with its store-wide reads (listing, index, batches, status, the store's
integrity and head); its reads of one rollout live in `capture_proxy.read.verified_reads`, its
reads over many in `capture_proxy.read.selection`, bound to it as its methods.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from ..schemas.digest import MessageDigestCache, RequestValueCache
from ..schemas.records import CommitCoords, LedgerEntry, RolloutInfo
from ..schemas.store_head import StoreHead
from ..sinks.base import Progress, StagingSource, StoreDamaged
from ..sinks.registry import open_source
from ..sinks.rollout_index import IndexedRollout, RolloutQuery, State, indexed
from . import selection, verified_reads
from .integrity import (
    Problem,
    RolloutUnverified,
    StoreCorrupted,
    store_head_of,
    store_problems,
)

# Importable from here as before the reads moved out of this module.
from .selection import RewardView as RewardView
from .selection import SelectedRollout as SelectedRollout
from .selection import as_epoch_ms as as_epoch_ms
from .status import RolloutExcluded, RolloutStatus, rollout_status

if TYPE_CHECKING:
    from .batches import RolloutBatch

__all__ = [
    "Problem",
    "RolloutExcluded",
    "RolloutUnverified",
    "Store",
    "StoreCorrupted",
    "open_store",
]

log = logging.getLogger("capture_proxy.read")


def _one_listing(source: StagingSource) -> contextlib.AbstractContextManager[object]:
    """The source's ``snapshot()`` where it has one (`ParquetSource`: its reads share one
    listing of the units instead of listing them once each); a no-op for the others."""
    snapshot = getattr(source, "snapshot", None)
    return snapshot() if callable(snapshot) else contextlib.nullcontext()


class Store:
    """A staged-data store opened for reading (SQLite file, Parquet dataset, or a proxy's store
    over HTTP)."""

    def __init__(self, source: StagingSource) -> None:
        self.source = source
        self.url = source.url
        # A rollout's history recurs in every call: verify each distinct message once.
        self._digester = MessageDigestCache()
        self._encoder = RequestValueCache()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.source.close_reader()

    def rollouts(
        self,
        *,
        state: State | None = None,
        since: int | datetime | None = None,
        group: str | Iterable[str] | None = None,
        graded: bool | None = None,
    ) -> list[str]:
        """Rollout ids, oldest first; the keywords keep those of a state (``open`` / ``sealed``,
        poisoned ones left out; or ``poisoned``), sealed at or after `since`, of a group (or
        several) or with (without) an outcome, from the store's rollout index: the cost follows
        what is returned, not the store (`index`)."""
        if state is None and since is None and group is None and graded is None:
            return self.source.rollouts()
        return [
            r.rollout_id for r in self.index(state=state, since=since, group=group, graded=graded)
        ]

    def index(
        self,
        *,
        state: State | None = None,
        since: int | datetime | None = None,
        group: str | Iterable[str] | None = None,
        graded: bool | None = None,
    ) -> list[IndexedRollout]:
        """The rollout index's rows (state, poisoned flag, seal time, group, graded) of the
        rollouts the keywords keep (as `rollouts`). ``poisoned`` there is what the header and
        ledger say; `status` also reads the event log (calls lost in a crash)."""
        groups = None if group is None else frozenset([group] if isinstance(group, str) else group)
        query = RolloutQuery(state, as_epoch_ms(since), groups, graded)
        return indexed(self.source, query)

    def next_batch(
        self, consumer: str, *, wait_s: float | None = 30.0, **ask: int | None
    ) -> RolloutBatch | None:
        """The consumer's next batch: ``rollouts=N`` rollouts or ``groups=N`` complete groups of
        ``group_size=S``, sealed, graded, not poisoned, verified, and (``max_staleness=K``) not
        more than K weight versions behind ``current_version=`` (default: the driver's). Waits
        up to `wait_s` seconds (None: forever); None when none was ready. Delivered again until
        `RolloutBatch.ack`; see `capture_proxy.read.batches` and docs/batches.md."""
        from .batches import BatchRequest, next_batch

        return next_batch(self, consumer, BatchRequest(**ask), wait_s=wait_s)

    def batches(
        self, consumer: str, *, wait_s: float | None = None, **ask: int | None
    ) -> Iterator[RolloutBatch]:
        """`next_batch` again and again: ``for batch in store.batches("trainer-a", groups=4,
        group_size=8): ...; batch.ack()``. Blocks for each batch; ends when none came within
        `wait_s` (default: waits forever). A batch not acknowledged comes again."""
        from .batches import BatchRequest, iter_batches

        return iter_batches(self, consumer, BatchRequest(**ask), wait_s=wait_s)

    def rollout_info(self, rollout_id: str) -> RolloutInfo:
        return self.source.rollout_info(rollout_id)

    def status(self, rollout_id: str) -> RolloutStatus:
        """The rollout's state, whether it is poisoned and its not-staged calls (KeyError if
        unknown)."""
        return rollout_status(self.source, rollout_id)

    def failures(self, rollout_id: str) -> list[LedgerEntry]:
        """What was not staged in the rollout, and why."""
        return self.source.failures(rollout_id)

    def coords(self, keys: Sequence[str]) -> list[CommitCoords]:
        return self.source.coords(keys)

    def problems(
        self,
        *,
        progress: Progress | None = None,
        expected_store_head: StoreHead | str | None = None,
    ) -> list[Problem]:
        """Every integrity problem in the store (empty when it verifies). `progress` is told
        ``(records checked, records + 1)`` as it goes, and ``(n, n)`` once the store-wide
        checks (attachments, sequence numbers) are done.

        `expected_store_head` is the store head its writer published last (its log's
        ``store_head`` line or ``capture_proxy_store_head_info``; a `StoreHead` or its
        ``HEAD[:ROLLOUTS[:EVENTS]]`` text): the store's head is recomputed and a difference is
        a problem (key ``store``) saying how it differs: a rollout deleted, cut short, rewritten
        (docs/digest.md, "The store head").

        The checks read one snapshot of a Parquet dataset (one listing of its units, however
        many records: what is committed meanwhile is left for the next run)."""
        kept = (
            StoreHead.parse(expected_store_head)
            if isinstance(expected_store_head, str)
            else expected_store_head
        )
        with _one_listing(self.source):
            return store_problems(self.source, self._digester, self._encoder, progress, kept)

    def store_head(self) -> StoreHead:
        """The store head recomputed from the store (docs/digest.md, "The store head").
        `StoreDamaged` when an event holds no value a writer writes."""
        with _one_listing(self.source):
            heads = []
            for rollout_id in self.source.rollouts():
                events = self.source.events(rollout_id)
                if events:
                    heads.append((rollout_id, events[-1].hash, events[-1].position))
            try:
                return store_head_of(self.source, heads)
            except (TypeError, ValueError, UnicodeError) as e:
                raise StoreDamaged(f"{self.url}: its store head cannot be computed: {e}") from e

    def verify(self, *, expected_store_head: StoreHead | str | None = None) -> None:
        """Raise `StoreCorrupted` listing every problem, or return None when all verifies
        (and the store's head is `expected_store_head`, when given: see `problems`)."""
        found = self.problems(expected_store_head=expected_store_head)
        if found:
            raise StoreCorrupted(found)

    # -- the rest, one module per concern, bound here as methods -------------------------------

    # One rollout, or records by key, verified (`read/verified_reads.py`).
    calls = verified_reads.calls
    _records = verified_reads.stored_records
    check = verified_reads.check
    _problems_of = verified_reads.problems_of
    _verified = verified_reads.verified
    fetch = verified_reads.fetch
    trajectory = verified_reads.trajectory
    _read = verified_reads.read_rollout
    routed_experts = verified_reads.routed_experts

    # Many rollouts: which the filters keep, and the iterating reads (`read/selection.py`).
    _select = selection.select
    iter_trajectories = selection.iter_trajectories
    iter_read = selection.iter_read
    _take = selection.take


def open_store(url: str, *, token: str | None = None) -> Store:
    """Open a store for reading: ``sqlite:///path.db``, ``parquet:///dir``, ``s3://bucket/prefix``,
    or ``http://HOST:PORT`` (``https://``): the store of a running proxy, read through its control
    API with `token`, its ``--reader-token`` or ``--admin-token`` (default: the environment's
    ``CAPTURE_PROXY_READER_TOKEN``). A remote store has the same read API; its records are
    verified here, on the reading side (docs/contract.md, "Reading the store from another host").

    Raises `StoreError` when there is no store there; for a proxy, `StoreAccessDenied` (a
    `StoreError`) when it refuses the token.
    """
    return Store(open_source(url, token=token))
