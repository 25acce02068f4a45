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
`capture_proxy.read.status`) and ``verify=True`` (recompute every record's digest on read;
``verify=False`` skips it, for data already verified). The iterator skips what the filters leave
out; `calls` and `trajectory`, asked for one rollout by name, raise `RolloutExcluded` naming
the keyword to pass. `fetch` and `verify` always check digests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..errors import CaptureProxyError
from ..schemas.digest import (
    DigestMismatch,
    MessageDigestCache,
    RequestValueCache,
    verify_record,
)
from ..schemas.events import EventKind, check_chain
from ..schemas.records import (
    CommitCoords,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from ..sinks.base import Progress, StagingSource
from ..sinks.registry import open_source
from ..sinks.rollout_index import IndexedRollout, RolloutQuery, State, indexed
from .status import RolloutExcluded, RolloutStatus, check_included, read_header, rollout_status

if TYPE_CHECKING:
    from .batches import RolloutBatch
    from .cursor import ExportCursor
    from .trajectory import Trajectory

__all__ = ["Problem", "RolloutExcluded", "Store", "StoreCorrupted", "open_store"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing `verify` found wrong: which key (attachment, rollout) and what."""

    key: str
    message: str


class StoreCorrupted(CaptureProxyError):
    """`Store.verify` found problems; `.problems` lists every one of them."""

    def __init__(self, problems: list[Problem]) -> None:
        lines = "\n".join(f"  {p.key}: {p.message}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{len(problems)} problem(s) in the store:\n{lines}{more}")
        self.problems = problems


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
        unless `include_poisoned`, KeyError for an unknown one, and `DigestMismatch` when a
        record does not verify (unless ``verify=False``). `include_orphaned` adds records
        marked orphaned (they poison their rollout, so it needs `include_poisoned` too).
        """
        check_included(
            rollout_id,
            self.status(rollout_id),
            include_open=include_open,
            include_poisoned=include_poisoned,
        )
        records = self.source.calls(rollout_id, include_orphaned=include_orphaned)
        if verify:
            self._verify(records)
        return records

    def _verify(self, records: Iterable[StagedCallRecord]) -> None:
        for record in records:
            verify_record(record, digester=self._digester, encoder=self._encoder)

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

    def problems(self, *, progress: Progress | None = None) -> list[Problem]:
        """Every integrity problem in the store (empty when it verifies). `progress` is told
        ``(records checked, records + 1)`` as it goes, and ``(n, n)`` once the store-wide
        checks (attachments, sequence numbers) are done.

        The checks read one snapshot of a Parquet dataset (one listing of its units, however
        many records: what is committed meanwhile is left for the next run)."""
        with _one_listing(self.source):
            return self._problems(progress)

    def _problems(self, progress: Progress | None) -> list[Problem]:
        found: list[Problem] = []
        keys = list(self.source.all_keys())
        for done, key in enumerate(keys, 1):
            if progress is not None:
                progress(done - 1, len(keys) + 1)
            try:
                (record,) = self.source.fetch([key])
                verify_record(record, digester=self._digester, encoder=self._encoder)
            except DigestMismatch as e:
                found.append(Problem(key, str(e)))
            except Exception as e:  # a torn or undecodable row is a problem to report, not a crash
                found.append(Problem(key, f"unreadable: {type(e).__name__}: {e}"))
        for sha in self.source.unreferenced_attachments():
            found.append(Problem(f"attachment:{sha}", "attachment without a record"))
        found.extend(self._duplicate_seqs())
        found.extend(self._event_logs())
        if progress is not None:
            progress(len(keys) + 1, len(keys) + 1)
        return found

    def _event_logs(self) -> list[Problem]:
        """Each rollout's event log: its hash chain holds (a deleted or edited event is named by
        its position), and what it says was staged or put in the ledger is still there, as it
        was. A claimed call with neither a record nor a ledger entry is not a problem here: it
        is ``lost_in_crash``, which `status` reports (the rollout is poisoned). Rollouts
        written before event logs have none: nothing to check."""
        found: list[Problem] = []
        for rollout_id in self.source.rollouts():
            events = self.source.events(rollout_id)
            if not events:
                continue
            key = f"rollout:{rollout_id}"
            for br in check_chain(events):
                found.append(
                    Problem(key, f"event log broken at position {br.position}: {br.message}")
                )
            staged = {s.call_id: s for s in self.source.summaries(rollout_id)}
            ledger = {
                (f.call_id, f.status.value, f.reason) for f in self.source.failures(rollout_id)
            }
            digests = dict(
                zip(staged, (c.digest for c in self.source.coords(list(staged))), strict=True)
            )
            for e in events:
                where = f"seq {e.seq} (call {e.call_id}, event {e.position})"
                if e.kind == EventKind.STAGED and e.call_id is not None:
                    if e.call_id not in staged:
                        found.append(Problem(key, f"{where} was staged; its record is missing"))
                    elif digests[e.call_id] != e.body.get("digest"):
                        found.append(
                            Problem(key, f"{where}: the record's digest is not the one staged")
                        )
                elif e.kind == EventKind.LEDGER and e.call_id is not None:
                    entry = (e.call_id, e.body.get("status"), e.body.get("reason"))
                    if entry not in ledger:
                        found.append(
                            Problem(
                                key,
                                f"{where} is in the event log as {entry[1]} ({entry[2]}); its "
                                "ledger entry is missing or changed",
                            )
                        )
        return found

    def _duplicate_seqs(self) -> list[Problem]:
        """Sequence numbers held by more than one call of a rollout (staged or in the ledger).

        Stores refuse them now; a store written before that rule, or by two writers at once,
        may hold some: the rollout's order and lineage are then ambiguous. A call's own record
        and ledger entry (a write that landed after its caller gave up) are one call.
        """
        found: list[Problem] = []
        for rollout_id in self.source.rollouts():
            holders: dict[int, set[str]] = {}
            for summary in self.source.summaries(rollout_id):
                holders.setdefault(summary.seq, set()).add(summary.call_id)
            for failure in self.source.failures(rollout_id):
                holders.setdefault(failure.seq, set()).add(failure.call_id)
            for seq, calls in sorted(holders.items()):
                if len(calls) > 1:
                    found.append(
                        Problem(
                            f"rollout:{rollout_id}",
                            f"seq {seq} is held by {len(calls)} calls ({', '.join(sorted(calls))})",
                        )
                    )
        return found

    def verify(self) -> None:
        """Raise `StoreCorrupted` listing every problem, or return None when all verifies."""
        found = self.problems()
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
    ) -> Trajectory:
        """The rollout as one training episode; see `capture_proxy.read.trajectory.Trajectory`.

        Raises like `calls`: `RolloutExcluded` for an open or poisoned rollout not asked for,
        KeyError for an unknown one, `DigestMismatch` for a record that does not verify.
        """
        status = self.status(rollout_id)
        check_included(
            rollout_id, status, include_open=include_open, include_poisoned=include_poisoned
        )
        return self._read(rollout_id, status, include_untooled, verify)[1]

    def _read(
        self, rollout_id: str, status: RolloutStatus, include_untooled: bool, verify: bool
    ) -> tuple[list[StagedCallRecord], Trajectory]:
        """The rollout's records and its trajectory, with the driver's outcome on it: the one
        place trajectories are built for `trajectory`, `iter_trajectories` and the export."""
        from .trajectory import trajectory_from_records

        records = self.source.calls(rollout_id)
        if verify:
            self._verify(records)
        # The status carries the driver's latest outcome: the trajectory's reward and group.
        traj = trajectory_from_records(
            rollout_id, records, include_untooled=include_untooled, status=status
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
    ) -> str | None:
        """The call's routed experts over its whole prompt + completion, or None when its record
        has none (vLLM without ``--enable-return-routed-experts``).

        A record stores only the rows its parent did not (`capture_proxy.read.experts`); this
        rebuilds the full array, as vLLM encodes it: a base64 ``.npy`` string whose first axis
        is the position. Raises like `calls` (`RolloutExcluded`, KeyError, `DigestMismatch`),
        `ExpertsIncomplete` when the call is flagged ``routed_experts_incomplete`` (unless
        `allow_incomplete`: then the rows before its start are its parent's) and
        `ExpertsUnavailable` when a record of the chain is missing.
        """
        from .experts import assemble_experts

        def fetch(key: str) -> StagedCallRecord:
            if verify:
                (found,) = self.fetch([key])
            else:
                (found,) = self.source.fetch([key])
            return found

        record = fetch(call_id)
        check_included(
            record.rollout_id,
            self.status(record.rollout_id),
            include_open=include_open,
            include_poisoned=include_poisoned,
        )
        return assemble_experts(fetch, record, allow_incomplete=allow_incomplete)

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
        kept: list[SelectedRollout] = []
        if cursor is not None:
            ids = [r for r in ids if r not in cursor]
        for rollout_id in ids:
            # One header read per rollout: its outcome, its seal time and its status.
            header = read_header(self.source, rollout_id)
            outcome = RewardView.of(header)
            if groups is not None and outcome.group_id not in groups:
                continue
            sealed_at = None if header is None else header.sealed_at_ms
            # `since` compares the seal time the writing proxy decided, not when the seal became
            # visible here (the cursor is the exact way). An open rollout (no seal time yet) is
            # kept when open rollouts are asked for.
            if since_ms is not None and sealed_at is not None and sealed_at < since_ms:
                continue
            status = rollout_status(self.source, rollout_id, header)
            try:
                check_included(
                    rollout_id, status, include_open=include_open, include_poisoned=include_poisoned
                )
            except RolloutExcluded as e:
                if skipped is not None:
                    why = "poisoned" if e.keyword == "include_poisoned" else "open"
                    skipped.setdefault(why, []).append(rollout_id)
                continue
            kept.append(SelectedRollout(rollout_id, status, sealed_at, outcome))
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
    ) -> Iterator[Trajectory]:
        """Every rollout's trajectory, oldest rollout first, one rollout in memory at a time.

        The rollouts of one group (`Trajectory.group_id`) come one after the other, at the place
        of the group's oldest rollout. Open rollouts (unless `include_open`) and poisoned ones
        (unless `include_poisoned`) are left out; pass a dict as `skipped` to learn which: it
        gets ``"open"`` and ``"poisoned"`` lists of rollout ids (a rollout both open and
        poisoned is counted as poisoned). `group` (a group id, or several) keeps only those
        groups.

        A training loop that reads incrementally passes the same `cursor`
        (`capture_proxy.read.cursor.ExportCursor`) to every pass: each sealed rollout is then
        yielded exactly once over all passes, however late it became visible in the store. The
        rollouts in the cursor are skipped, and each sealed rollout is added to it as its
        trajectory is yielded (a pass stopped early has taken only what it got).

        `since` (a `datetime`, or milliseconds since the epoch) keeps only rollouts whose seal
        time is at or after it. The seal time is the writing proxy's clock when it sealed, not
        when the seal became visible here: a rollout sealed before `since` but visible only
        after an earlier pass read the store is in neither pass. Use `cursor` to read
        incrementally; `since` selects by time.

        Rollouts without any staged call yield nothing. Raises `DigestMismatch` when a record
        does not verify (unless ``verify=False``).
        """
        selected = self._select(
            include_open=include_open,
            include_poisoned=include_poisoned,
            since=since,
            group=group,
            rollouts=None,
            skipped=skipped,
            cursor=cursor,
        )
        for sel in selected:
            traj = self._read(sel.rollout_id, sel.status, include_untooled, verify)[1]
            if cursor is not None and sel.status.state is RolloutState.SEALED:
                cursor.add((sel.rollout_id,))
            if traj.calls or traj.apart:
                yield traj


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
