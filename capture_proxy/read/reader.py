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
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..schemas.digest import (
    DigestMismatch,
    MessageDigestCache,
    RequestValueCache,
    verify_record,
)
from ..schemas.records import (
    CommitCoords,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from ..schemas.store_head import StoreHead, StoreHeadState
from ..sinks.base import Progress, StagingSource, StoreDamaged
from ..sinks.registry import open_source
from ..sinks.rollout_index import IndexedRollout, RolloutQuery, State, indexed
from .integrity import (
    Problem,
    RolloutUnverified,
    StoreCorrupted,
    rollout_problems,
    store_problems,
)
from .status import (
    RolloutExcluded,
    RolloutFacts,
    RolloutStatus,
    check_included,
    read_header,
    rollout_status,
    status_of,
)

if TYPE_CHECKING:
    from .batches import RolloutBatch
    from .cursor import ExportCursor
    from .trajectory import Trajectory

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


def _key_of(item: str | CommitCoords | Mapping[str, Any]) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, CommitCoords):
        return item.staging_key
    return str(item["staging_key"])


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

    def calls(
        self,
        rollout_id: str,
        *,
        include_orphaned: bool = False,
        include_open: bool = False,
        include_poisoned: bool = False,
        verify: bool = True,
    ) -> list[StagedCallRecord]:
        """The rollout's staged records in sequence order (failures are not records).

        Raises `RolloutExcluded` for an open rollout unless `include_open`, for a poisoned one
        unless `include_poisoned`, `RolloutUnverified` for one that does not verify (unless
        ``verify=False``; `capture_proxy.read.integrity`), KeyError for an unknown one.
        `include_orphaned` adds records marked orphaned (they poison their rollout, so it needs
        `include_poisoned` too).
        """
        facts = RolloutFacts.read(self.source, rollout_id)
        check_included(
            rollout_id,
            status_of(facts),
            include_open=include_open,
            include_poisoned=include_poisoned,
        )
        records = self._records(rollout_id, include_orphaned, verify)
        if verify:
            records = self._verified(facts, records, include_orphaned, None)[1]
        return records

    def _records(
        self, rollout_id: str, include_orphaned: bool, verify: bool
    ) -> list[StagedCallRecord]:
        """The rollout's records as stored; a store too damaged to decode them (`StoreDamaged`)
        is, for a verified read, a rollout that does not verify."""
        try:
            return self.source.calls(rollout_id, include_orphaned=include_orphaned)
        except StoreDamaged as e:
            if not verify:
                raise
            raise RolloutUnverified(rollout_id, [str(e)]) from e

    def check(self, rollout_id: str, *, expected_head: str | None = None) -> list[str]:
        """Everything wrong with the rollout as a trainer would read it ([] when it verifies):
        the checks `verify=True` makes (`capture_proxy.read.integrity`), orphaned records
        included. `expected_head` is the rollout's chain head as its driver kept it (the seal
        or outcome answer's ``chain_head``). KeyError for an unknown rollout."""
        facts = RolloutFacts.read(self.source, rollout_id)
        records = self.source.calls(rollout_id, include_orphaned=True)
        return self._problems_of(facts, records, expected_head)

    def _problems_of(
        self,
        facts: RolloutFacts,
        records: list[StagedCallRecord],
        expected_head: str | None,
    ) -> list[str]:
        return rollout_problems(
            facts,
            records,
            lambda keys: [c.digest for c in self.source.coords(keys)],
            expected_head=expected_head,
            digester=self._digester,
            encoder=self._encoder,
        )

    def _verified(
        self,
        facts: RolloutFacts,
        records: list[StagedCallRecord],
        include_orphaned: bool,
        expected_head: str | None,
    ) -> tuple[RolloutFacts, list[StagedCallRecord]]:
        """The rollout's facts and records once they verify; `RolloutUnverified` otherwise.

        The facts and the records are separate reads: a call staged between them (an open
        rollout, read while its proxy writes) or an outcome stored between them would read as
        a record or an outcome the chain does not account for. So a rollout that fails is read
        once more, and fails only when the second read fails too."""
        problems = self._problems_of(facts, records, expected_head)
        if problems:
            facts = RolloutFacts.read(self.source, facts.rollout_id)
            records = self._records(facts.rollout_id, include_orphaned, True)
            problems = self._problems_of(facts, records, expected_head)
            if problems:
                raise RolloutUnverified(facts.rollout_id, problems)
        return facts, records

    def failures(self, rollout_id: str) -> list[LedgerEntry]:
        """What was not staged in the rollout, and why."""
        return self.source.failures(rollout_id)

    def coords(self, keys: Sequence[str]) -> list[CommitCoords]:
        return self.source.coords(keys)

    def fetch(
        self, items: Iterable[str | CommitCoords | Mapping[str, Any]]
    ) -> list[StagedCallRecord]:
        """One verified record per key or coordinate, in order.

        Raises `KeyError` for a missing key and `DigestMismatch` when stored bytes no longer
        match their digest, or when a coordinate's digest differs from the stored record's.
        """
        items = list(items)
        records = self.source.fetch([_key_of(i) for i in items])
        for item, record in zip(items, records, strict=True):
            verify_record(record, digester=self._digester, encoder=self._encoder)
            want = (
                item.digest
                if isinstance(item, CommitCoords)
                else (item.get("digest") if isinstance(item, Mapping) else None)
            )
            if want is not None and want != record.digest:
                raise DigestMismatch(record.staging_key, "coordinate digest", want, record.digest)
        return records

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
            return StoreHeadState.of(heads).head()
        except (TypeError, ValueError, UnicodeError) as e:
            raise StoreDamaged(f"{self.url}: its store head cannot be computed: {e}") from e

    def verify(self, *, expected_store_head: StoreHead | str | None = None) -> None:
        """Raise `StoreCorrupted` listing every problem, or return None when all verifies
        (and the store's head is `expected_store_head`, when given: see `problems`)."""
        found = self.problems(expected_store_head=expected_store_head)
        if found:
            raise StoreCorrupted(found)

    def trajectory(
        self,
        rollout_id: str,
        *,
        include_untooled: bool = False,
        include_open: bool = False,
        include_poisoned: bool = False,
        verify: bool = True,
        expected_head: str | None = None,
    ) -> Trajectory:
        """The rollout as one training episode; see `capture_proxy.read.trajectory.Trajectory`.

        Raises like `calls`: `RolloutExcluded` for an open or poisoned rollout not asked for,
        `RolloutUnverified` for one that does not verify, KeyError for an unknown one.
        `expected_head` (the seal or outcome answer's ``chain_head`` its driver kept) refuses
        the rollout unless its stored chain ends there (checked only with ``verify=True``).
        """
        facts = RolloutFacts.read(self.source, rollout_id)
        check_included(
            rollout_id,
            status_of(facts),
            include_open=include_open,
            include_poisoned=include_poisoned,
        )
        return self._read(facts, include_untooled, verify, expected_head)[1]

    def _read(
        self,
        facts: RolloutFacts,
        include_untooled: bool,
        verify: bool,
        expected_head: str | None = None,
    ) -> tuple[list[StagedCallRecord], Trajectory]:
        """The rollout's records and its trajectory, with the driver's outcome on it: the one
        place trajectories are built for `trajectory`, `iter_trajectories` and the export.
        Raises `RolloutUnverified` (``verify=True``) when the rollout does not verify."""
        from .trajectory import trajectory_from_records

        records = self._records(facts.rollout_id, False, verify)
        if verify:
            facts, records = self._verified(facts, records, False, expected_head)
        # The status carries the driver's latest outcome: the trajectory's reward and group.
        traj = trajectory_from_records(
            facts.rollout_id, records, include_untooled=include_untooled, status=status_of(facts)
        )
        return records, traj

    def routed_experts(
        self,
        call_id: str,
        *,
        include_open: bool = False,
        include_poisoned: bool = False,
        verify: bool = True,
        allow_incomplete: bool = False,
        expected_head: str | None = None,
    ) -> str | None:
        """The call's routed experts over its whole prompt + completion, or None when its record
        has none (vLLM without ``--enable-return-routed-experts``).

        A record stores only the rows its parent did not (`capture_proxy.read.experts`); this
        rebuilds the full array, as vLLM encodes it: a base64 ``.npy`` string whose first axis
        is the position. With ``verify=True`` the call's rollout must verify as a whole, as for
        `trajectory` (`capture_proxy.read.integrity`; `expected_head` anchors it): the rows come
        from the records it verified. Raises like `calls` (`RolloutExcluded`,
        `RolloutUnverified`, KeyError, `DigestMismatch`), `ExpertsIncomplete` when the call is
        flagged ``routed_experts_incomplete`` (unless `allow_incomplete`: then the rows before
        its start are its parent's) and `ExpertsUnavailable` when a record of the chain is
        missing.
        """
        from .experts import assemble_experts

        (asked,) = self.source.fetch([call_id])  # KeyError when no record has the id
        facts = RolloutFacts.read(self.source, asked.rollout_id)
        check_included(
            facts.rollout_id,
            status_of(facts),
            include_open=include_open,
            include_poisoned=include_poisoned,
        )
        records = self._records(facts.rollout_id, True, verify)
        if verify:
            records = self._verified(facts, records, True, expected_head)[1]
        verified = {r.call_id: r for r in records}

        def fetch(key: str) -> StagedCallRecord:
            found = verified.get(key)
            if found is not None:
                return found
            # A parent in another rollout (none is written so): its digest at least.
            (found,) = self.fetch([key]) if verify else self.source.fetch([key])
            return found

        return assemble_experts(fetch, fetch(call_id), allow_incomplete=allow_incomplete)

    def _select(
        self,
        *,
        include_open: bool,
        include_poisoned: bool,
        since: int | datetime | None,
        group: str | Iterable[str] | None,
        rollouts: Iterable[str] | None,
        skipped: dict[str, list[str]] | None,
        cursor: ExportCursor | None = None,
        expected_heads: Mapping[str, str] | None = None,
        unverified: dict[str, list[str]] | None = None,
    ) -> list[SelectedRollout]:
        """The rollouts the filters keep, in export order: oldest first, except that the
        rollouts of one group follow each other (at the place of the group's oldest rollout),
        so a GRPO group is adjacent. Reads headers and ledgers only, no records; none for the
        rollouts `cursor` already took."""
        since_ms = as_epoch_ms(since)
        groups = {group} if isinstance(group, str) else None if group is None else set(group)
        if rollouts is None and (groups is not None or (since_ms is not None and not include_open)):
            # The rollout index narrows first: the reads below follow what is kept, not the
            # store. (An open rollout has no seal time: with include_open, `since` cannot.)
            query = RolloutQuery(
                since_ms=None if include_open else since_ms,
                groups=None if groups is None else frozenset(groups),
            )
            ids = [r.rollout_id for r in indexed(self.source, query)]
        elif rollouts is None:
            ids = self.rollouts()
        else:
            known = self.rollouts()
            wanted = set(rollouts)
            missing = sorted(wanted.difference(known))
            if missing:
                raise KeyError(f"no rollout {', '.join(map(repr, missing))} in {self.url}")
            ids = [r for r in known if r in wanted]
        if expected_heads is not None:
            # An anchored read takes the rollouts its driver vouches for, and says which of
            # those the store lost and which others it holds.
            if skipped is not None:
                gone = sorted(set(expected_heads).difference(self.source.rollouts()))
                skipped.setdefault("missing", []).extend(gone)
                skipped.setdefault("unanchored", []).extend(
                    r for r in ids if r not in expected_heads
                )
            ids = [r for r in ids if r in expected_heads]
        kept: list[SelectedRollout] = []
        if cursor is not None:
            ids = [r for r in ids if r not in cursor]
        for rollout_id in ids:
            # One header read per rollout: its outcome, its seal time and its status.
            try:
                header = read_header(self.source, rollout_id)
            except StoreDamaged as e:
                log.warning("left out: rollout %r: %s", rollout_id, e)
                if skipped is not None:
                    skipped.setdefault("unverified", []).append(rollout_id)
                if unverified is not None:
                    unverified[rollout_id] = [str(e)]
                continue
            outcome = RewardView.of(header)
            if groups is not None and outcome.group_id not in groups:
                continue
            sealed_at = None if header is None else header.sealed_at_ms
            # `since` compares the seal time the writing proxy decided, not when the seal became
            # visible here (the cursor is the exact way). An open rollout (no seal time yet) is
            # kept when open rollouts are asked for.
            if since_ms is not None and sealed_at is not None and sealed_at < since_ms:
                continue
            try:
                facts = RolloutFacts.read(self.source, rollout_id, header)
            except StoreDamaged as e:
                # Its ledger or event log cannot be decoded: it does not verify, whatever the
                # filters (a verified read would refuse it; an unverified one cannot read it).
                log.warning("left out: rollout %r: %s", rollout_id, e)
                if skipped is not None:
                    skipped.setdefault("unverified", []).append(rollout_id)
                if unverified is not None:
                    unverified[rollout_id] = [str(e)]
                continue
            status = status_of(facts)
            try:
                check_included(
                    rollout_id, status, include_open=include_open, include_poisoned=include_poisoned
                )
            except RolloutExcluded as e:
                if skipped is not None:
                    why = "poisoned" if e.keyword == "include_poisoned" else "open"
                    skipped.setdefault(why, []).append(rollout_id)
                continue
            kept.append(SelectedRollout(rollout_id, status, sealed_at, outcome, facts))
        # Each rollout sorts at the place of its group's first rollout (its own place when it
        # has no group): groups stay together, everything else keeps the store's order.
        first: dict[str, int] = {}
        places = [
            first.setdefault(s.outcome.group_id, i) if s.outcome.group_id is not None else i
            for i, s in enumerate(kept)
        ]
        order = sorted(range(len(kept)), key=lambda i: (places[i], i))
        return [kept[i] for i in order]

    def iter_trajectories(
        self,
        *,
        include_untooled: bool = False,
        include_open: bool = False,
        include_poisoned: bool = False,
        verify: bool = True,
        since: int | datetime | None = None,
        group: str | Iterable[str] | None = None,
        skipped: dict[str, list[str]] | None = None,
        cursor: ExportCursor | None = None,
        expected_heads: Mapping[str, str] | None = None,
        unverified: dict[str, list[str]] | None = None,
    ) -> Iterator[Trajectory]:
        """Every rollout's trajectory, oldest rollout first, one rollout in memory at a time.

        The rollouts of one group (`Trajectory.group_id`) come one after the other, at the place
        of the group's oldest rollout. Open rollouts (unless `include_open`), poisoned ones
        (unless `include_poisoned`) and ones that do not verify (unless ``verify=False``:
        `capture_proxy.read.integrity`) are left out; pass a dict as `skipped` to learn which:
        it gets ``"open"``, ``"poisoned"`` and ``"unverified"`` lists of rollout ids (a rollout
        both open and poisoned is counted as poisoned), and a dict as `unverified` to learn
        why: rollout id -> its problems. Each rollout left out as unverified is also logged as
        a warning (logger ``capture_proxy.read``). `group` (a group id, or several) keeps only
        those groups.

        `expected_heads` anchors the read (docs/contract.md, "Anchored reads"): rollout id ->
        the ``chain_head`` of the last seal or outcome answer its driver kept
        (`capture_proxy.read.anchors.load_heads` reads a file of them). Only those rollouts are
        read, each only if its stored chain ends at that head (else it is unverified); the
        store's other rollouts are listed in ``skipped["unanchored"]``, and the anchored ones
        the store does not hold in ``skipped["missing"]``.

        A training loop that reads incrementally passes the same `cursor`
        (`capture_proxy.read.cursor.ExportCursor`) to every pass: each sealed rollout is then
        yielded exactly once over all passes, however late it became visible in the store. The
        rollouts in the cursor are skipped, and each sealed rollout is added to it as its
        trajectory is yielded (a pass stopped early has taken only what it got; one left out as
        unverified is not taken, so the next pass reads it again).

        `since` (a `datetime`, or milliseconds since the epoch) keeps only rollouts whose seal
        time is at or after it. The seal time is the writing proxy's clock when it sealed, not
        when the seal became visible here: a rollout sealed before `since` but visible only
        after an earlier pass read the store is in neither pass. Use `cursor` to read
        incrementally; `since` selects by time.

        Rollouts without any staged call yield nothing.
        """
        for _, traj in self.iter_read(
            include_untooled=include_untooled,
            include_open=include_open,
            include_poisoned=include_poisoned,
            verify=verify,
            since=since,
            group=group,
            skipped=skipped,
            cursor=cursor,
            expected_heads=expected_heads,
            unverified=unverified,
        ):
            yield traj

    def iter_read(
        self,
        *,
        rollouts: Iterable[str] | None = None,
        include_untooled: bool = False,
        include_open: bool = False,
        include_poisoned: bool = False,
        verify: bool = True,
        since: int | datetime | None = None,
        group: str | Iterable[str] | None = None,
        skipped: dict[str, list[str]] | None = None,
        cursor: ExportCursor | None = None,
        expected_heads: Mapping[str, str] | None = None,
        unverified: dict[str, list[str]] | None = None,
    ) -> Iterator[tuple[list[StagedCallRecord], Trajectory]]:
        """`iter_trajectories` with each trajectory's records, read once and verified with it
        (for readers that need the records too, as the trainer adapters do); `rollouts` keeps
        those rollouts only (KeyError for one the store does not hold)."""
        selected = self._select(
            include_open=include_open,
            include_poisoned=include_poisoned,
            since=since,
            group=group,
            rollouts=rollouts,
            skipped=skipped,
            cursor=cursor,
            expected_heads=expected_heads,
            unverified=unverified,
        )
        for sel in selected:
            got = self._take(sel, include_untooled, verify, expected_heads, skipped, unverified)
            if got is None:
                continue
            records, traj = got
            if cursor is not None and sel.status.state is RolloutState.SEALED:
                cursor.add((sel.rollout_id,))
            if traj.calls or traj.apart:
                yield records, traj

    def _take(
        self,
        sel: SelectedRollout,
        include_untooled: bool,
        verify: bool,
        expected_heads: Mapping[str, str] | None,
        skipped: dict[str, list[str]] | None,
        unverified: dict[str, list[str]] | None,
    ) -> tuple[list[StagedCallRecord], Trajectory] | None:
        """A selected rollout's records and trajectory, or None when it does not verify (then
        said in `skipped`, `unverified` and the log): the iterating reads' and the export's."""
        facts = sel.facts or RolloutFacts.read(self.source, sel.rollout_id)
        head = None if expected_heads is None else expected_heads[sel.rollout_id]
        try:
            return self._read(facts, include_untooled, verify, head)
        except KeyError:
            return None  # removed since it was selected (gc): nothing left to read
        except RolloutUnverified as e:
            log.warning("left out: %s", e)
            if skipped is not None:
                skipped.setdefault("unverified", []).append(sel.rollout_id)
            if unverified is not None:
                unverified[sel.rollout_id] = list(e.problems)
            return None


@dataclass(frozen=True, slots=True)
class RewardView:
    """The reward and group of a rollout's latest outcome, as trainers read them: `reward` is
    None when the driver sent an object of numbers (then `reward_components` holds them)."""

    reward: float | None = None
    reward_components: dict[str, float] | None = None
    group_id: str | None = None

    @staticmethod
    def of(header: RolloutInfo | None) -> RewardView:
        """The latest outcome of a rollout header (none without a header or an outcome)."""
        outcome = None if header is None else header.outcome
        if outcome is None:
            return _NO_OUTCOME
        return RewardView(outcome.scalar_reward, outcome.reward_components, outcome.group_id)


_NO_OUTCOME = RewardView()


@dataclass(frozen=True, slots=True)
class SelectedRollout:
    """A rollout the trainer-facing filters keep, with what was read to decide it."""

    rollout_id: str
    status: RolloutStatus
    sealed_at_ms: int | None
    outcome: RewardView
    #: What was read to decide it (its ledger, summaries and event log), checked again by
    #: the read that takes it.
    facts: RolloutFacts | None = None


def as_epoch_ms(when: int | datetime | None) -> int | None:
    """`since` as milliseconds since the epoch (a naive datetime is taken as UTC)."""
    if when is None or (isinstance(when, int) and not isinstance(when, bool)):
        return when
    if isinstance(when, datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return int(when.timestamp() * 1000)
    raise TypeError(f"since must be a datetime or milliseconds since the epoch, not {when!r}")


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
