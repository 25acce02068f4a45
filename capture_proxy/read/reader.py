"""The trainer-facing reader: `open_store(url)`.

    >>> from capture_proxy import open_store
    >>> store = open_store("sqlite:///capture.db")
    >>> for traj in store.iter_trajectories():           # sealed, not poisoned, verified
    ...     traj.token_ids, traj.loss_mask, traj.logprobs
    >>> records = store.fetch(manifest_coords)           # verifies every digest; raises on mismatch
    >>> store.verify()                                   # raises on any corruption in the store

The trainer-facing reads (`calls`, `trajectory`, `iter_trajectories`) take the same three
keywords, with safe defaults: ``include_open=False`` (leave out rollouts not sealed yet),
``include_poisoned=False`` (leave out rollouts with a call answered but not staged, see
`capture_proxy.read.status`) and ``verify=True`` (recompute every record's digest on read;
``verify=False`` skips it, for data already verified). The iterator skips what the filters leave
out; `calls` and `trajectory`, asked for one rollout by name, raise `RolloutExcluded` naming
the keyword to pass. `fetch` and `verify` always check digests.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CaptureProxyError
from ..schemas.digest import (
    DigestMismatch,
    MessageDigestCache,
    RequestValueCache,
    verify_record,
)
from ..schemas.events import EventKind, check_chain
from ..schemas.records import CommitCoords, LedgerEntry, RolloutInfo, StagedCallRecord
from ..sinks.base import StagingSource
from ..sinks.registry import open_source
from .status import RolloutExcluded, RolloutStatus, check_included, rollout_status

if TYPE_CHECKING:
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


def _key_of(item: str | CommitCoords | Mapping[str, Any]) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, CommitCoords):
        return item.staging_key
    return str(item["staging_key"])


class Store:
    """A staged-data store opened for reading (SQLite file or Parquet dataset)."""

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

    def rollouts(self) -> list[str]:
        """Rollout ids, oldest first."""
        return self.source.rollouts()

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

    def problems(self) -> list[Problem]:
        """Every integrity problem in the store (empty when it verifies)."""
        found: list[Problem] = []
        for key in self.source.all_keys():
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
        return self._trajectory(rollout_id, status, include_untooled, verify)

    def _trajectory(
        self, rollout_id: str, status: RolloutStatus, include_untooled: bool, verify: bool
    ) -> Trajectory:
        from .trajectory import trajectory_from_records

        records = self.source.calls(rollout_id)
        if verify:
            self._verify(records)
        return trajectory_from_records(
            rollout_id, records, include_untooled=include_untooled, status=status
        )

    def iter_trajectories(
        self,
        *,
        include_untooled: bool = False,
        include_open: bool = False,
        include_poisoned: bool = False,
        verify: bool = True,
        skipped: dict[str, list[str]] | None = None,
    ) -> Iterator[Trajectory]:
        """Every rollout's trajectory, oldest rollout first, one rollout in memory at a time.

        Open rollouts (unless `include_open`) and poisoned ones (unless `include_poisoned`) are
        left out; pass a dict as `skipped` to learn which: it gets ``"open"`` and
        ``"poisoned"`` lists of rollout ids (a rollout both open and poisoned is counted as
        poisoned). Rollouts without any staged call yield nothing. Raises `DigestMismatch` when
        a record does not verify (unless ``verify=False``).
        """
        for rollout_id in self.rollouts():
            status = self.status(rollout_id)
            try:
                check_included(
                    rollout_id, status, include_open=include_open, include_poisoned=include_poisoned
                )
            except RolloutExcluded as e:
                if skipped is not None:
                    why = "poisoned" if e.keyword == "include_poisoned" else "open"
                    skipped.setdefault(why, []).append(rollout_id)
                continue
            traj = self._trajectory(rollout_id, status, include_untooled, verify)
            if traj.calls or traj.apart:
                yield traj


def open_store(url: str) -> Store:
    """Open a store for reading: ``sqlite:///path.db``, ``parquet:///dir``, ``s3://bucket/prefix``."""
    return Store(open_source(url))
