"""The trainer-facing reader: `open_store(url)`.

    >>> from capture_proxy import open_store
    >>> store = open_store("sqlite:///capture.db")
    >>> for rollout_id in store.rollouts():
    ...     traj = store.trajectory(rollout_id)          # token_ids, loss_mask, logprobs, ...
    >>> records = store.fetch(manifest_coords)           # verifies every digest; raises on mismatch
    >>> store.verify()                                   # raises on any corruption in the store

Everything read through `fetch` and `verify` is checked against its digest; `calls` returns the
records as stored (call `verify_record` on them, or use `fetch`, when integrity matters).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CaptureProxyError
from ..schemas.digest import (
    DigestMismatch,
    MessageDigestCache,
    RequestValueCache,
    verify_record,
)
from ..schemas.records import CommitCoords, LedgerEntry, RolloutInfo, StagedCallRecord
from ..sinks.base import StagingSource
from ..sinks.registry import open_source

if TYPE_CHECKING:
    from .trajectory import Trajectory

__all__ = ["Problem", "Store", "StoreCorrupted", "open_store"]


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

    def calls(self, rollout_id: str, *, include_orphaned: bool = False) -> list[StagedCallRecord]:
        """The rollout's staged records in sequence order (failures are not records)."""
        return self.source.calls(rollout_id, include_orphaned=include_orphaned)

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

    def trajectory(self, rollout_id: str, **options: Any) -> Trajectory:
        """The rollout as one training episode; see `capture_proxy.read.trajectory.Trajectory`."""
        from .trajectory import build_trajectory

        return build_trajectory(self.source, rollout_id, **options)


def open_store(url: str) -> Store:
    """Open a store for reading: ``sqlite:///path.db``, ``parquet:///dir``, ``s3://bucket/prefix``."""
    return Store(open_source(url))
