"""`ParquetSource`: read a Parquet dataset back (the `StagingSource` protocol).

The reader keeps an index of the committed units (`_index`) and loads row groups only
when a record is asked for, with LRU caches for row groups and for full token sequences. Every
public call first reads a listing of the commit markers begun no earlier than itself (those
named after the checkpoint's horizon, `_checkpoint`, and the checkpoint's etag: a reader opens
again when it changed), so a reader sees commits made after it was opened; reads asking at once
share one listing. When a compaction removed a file the reader had listed, the call re-lists
and retries. Inside ``with source.snapshot():`` a thread's calls share the listing taken as the
block starts (on object storage a listing is a LIST request per thousand units, so a read of
every record, as `verify` does, would otherwise list the dataset once per record).

A reader may be shared between threads (the proxy shares one across its worker threads): its
reads run at once, and a refresh indexes new units while they run (`_refresh`).

``index="units"`` is for readers that live as long as a proxy and read a few rollouts at a time
(resume, manifests, the writer's own lookups): its memory follows the store's units, not every
call, blob and event (`_index.UnitIndex`); it keeps live rollouts by id and a sealed one's places
packed under a hash of its id, and a rollout's calls and ledger (header, failures, event log) are
read from its units when asked for. The default
(``"calls"``) indexes every call and holds the whole ledger, for bulk reads.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterable, Sequence
from typing import Literal, TypeVar

import pyarrow.fs as pafs

from ...schemas.events import RolloutEvent
from ...schemas.records import (
    CallSummary,
    CommitCoords,
    LedgerEntry,
    RolloutInfo,
    StagedCallRecord,
)
from ...schemas.store_head import ClaimCount
from ..base import PROXY_STATE_ROLLOUT, StoreError
from ..rollout_index import IndexedRollout, RolloutQuery, row_of
from ._claims import claim_counts, read_claims
from ._cursors import ParquetCursors
from ._directory import Directory
from ._fs import DatasetFS
from ._index import (
    Index,
    Known,
    UnitIndex,
)
from ._layout import (
    ATTACHMENTS,
    DEDUP_WINDOW_S,
    GC_MARGIN_S,
    LEDGER,
    check_format,
    read_group,
    read_groups,
    read_table,
)
from ._refresh import Refreshing

__all__ = ["ParquetSource", "default_url"]

T = TypeVar("T")
#: Reads retried when files vanish under them (each retry follows a compaction's cleanup).
_ATTEMPTS = 5


def _order_of(path: str) -> int:
    """The order (commit time, ns) of the unit a data file ``<table>/<unit>.parquet`` is of."""
    return int(path.rsplit("/", 1)[-1].split("-", 1)[0])


def default_url(location: str) -> str:
    """The canonical store URL for a dataset location (what coordinates report)."""
    return location if "://" in location else f"parquet:///{location}"


class ParquetSource(Refreshing):
    """Reads the dataset at `location` (a folder path or a pyarrow filesystem URL).

    Raises `StoreError` when there is no dataset there and `StoreFormatError` when it was
    written by a newer capture-proxy. `filesystem` is a configured pyarrow filesystem that
    `location` is a path in (object storage with credentials, say). `cache_bytes` bounds the
    decoded row groups kept (weighed by what they cost in memory, not just their buffers),
    `cache_tokens` the rebuilt full sequences (a child is its parent's prefix plus a delta).
    With ``index="units"``, ``call_keys=False`` keeps no key of each call (16 bytes a call):
    `fetch`, `coords` and `full` then find a call only through its rollout (`calls`,
    `summaries`, or `full`'s `rollout_id`), or among the calls read lately.
    ``call_keys="on_demand"`` starts the same, and the first read by a key not read lately
    (`fetch`, `coords`, `full` without its rollout) reads every calls file's ids once and keeps
    a key per call from then on: what the writer's reader, lent to the proxy, does (a resume
    reads a rollout's calls through the rollout; a trainer reading the proxy by key needs keys).
    """

    def __init__(
        self,
        location: str,
        *,
        url: str | None = None,
        cache_bytes: int = 256 << 20,
        cache_tokens: int = 4_000_000,
        filesystem: pafs.FileSystem | None = None,
        dfs: DatasetFS | None = None,
        index: Literal["calls", "units"] = "calls",
        call_keys: bool | Literal["on_demand"] = True,
    ) -> None:
        self.url = url or default_url(location)
        self.dfs = dfs or DatasetFS(location, filesystem)
        # Object storage reached by URL (credentials from the environment): obstore fetches
        # whole small files in one GET each, where pyarrow asks for the size first.
        self._object_url = location if "://" in location and filesystem is None else None
        if self.dfs.local:
            self._object_url = None
        if not check_format(self.dfs):
            raise StoreError(f"no capture-proxy Parquet dataset at {location}")
        self._start()
        self._per_unit = index == "units"
        self._call_keys = call_keys is True or not self._per_unit
        self._keys_on_demand = call_keys == "on_demand" and self._per_unit
        #: A units index keeps the event heads until `event_heads` takes them.
        self._collect_heads = self._per_unit
        self._index: Index | UnitIndex = self._new_index()
        #: The rollout index, built at the first `indexed_rollouts` (`_directory`).
        self._directory: Directory | None = None
        self._caches(cache_bytes, cache_tokens, self._per_unit)

    def known(self) -> Known:
        """Everything a writer appending to this dataset must know (see `ParquetSink`)."""
        with self._current():  # (in a `snapshot`: its listing)
            return self._known()

    def _known(self) -> Known:
        idx = self._index
        # (Each taken once into a local: a refresh on another thread may drop them meanwhile.)
        attached = idx.attached if isinstance(idx, UnitIndex) else None
        if isinstance(idx, UnitIndex) and attached is not None:
            files, idx.attached = attached, None  # collected as the units were indexed
        else:
            files = self._attachment_files()
        headed = idx.headed if isinstance(idx, UnitIndex) else None
        called = idx.called if isinstance(idx, UnitIndex) else None
        if isinstance(idx, UnitIndex) and headed is not None and called is not None:
            # Collected while the units were indexed (a writer's open): kept no longer.
            rollouts = set(headed) | set(called)
            idx.headed = idx.called = None
        else:
            rollouts = set(self._headed_rollouts()) | set(self._rollouts_with_calls())
        return Known(
            attachments={sha: _order_of(path) for sha, path in files.items()},
            rollouts=rollouts,
            last_order=max(self._listing.max_order(), self._known_order),
        )

    def unsealed_rollouts(self) -> set[str] | None:
        """The rollouts a units index holds by id, as of its last refresh: every rollout but
        those whose seal event or sealed header it has indexed. None for a calls index."""
        with self._rw.shared():
            idx = self._index
            if not isinstance(idx, UnitIndex):
                return None
            return set(idx.rollout_ledger) | set(idx.rollout_units)

    def attachment_order(self, sha: str) -> int | None:
        """The order (commit time, ns) of the unit holding the newest copy of attachment `sha`,
        None when the dataset has none: what a writer that no longer remembers it checks a
        reference to it against (the window rule)."""

        def run() -> int | None:
            idx = self._index
            if isinstance(idx, Index):
                where = idx.attachments.get(sha)  # the first copy: an order not later
                return None if where is None else _order_of(where.path)
            for u, g in idx.attachments.find(sha, newest_first=True):
                path = idx.units[u][ATTACHMENTS]
                if sha in read_group(self.dfs, path, g, ["sha256"]).column(0).to_pylist():
                    return _order_of(path)
            return None

        return self._read(run)

    def rollout_keys(self, rollout_id: str) -> tuple[set[str], dict[int, str]]:
        """A rollout's staged call ids, and which call holds each seq (staged or in the ledger;
        the first one holds it): what a writer checks a new call of the rollout against."""

        def run() -> tuple[set[str], dict[int, str]]:
            refs = self._rollout_refs(rollout_id)
            seqs: dict[int, str] = {}
            for call_id, ref in refs:
                seqs.setdefault(ref.seq, call_id)
            for f in self._ledger_of(rollout_id).failures.get(rollout_id, ()):
                seqs.setdefault(f.seq, f.call_id)
            return {k for k, _ in refs}, seqs

        return self._read(run)

    def full(self, key: str, rollout_id: str | None = None) -> array[int]:
        """A staged call's prompt + completion (shared with a cache: do not modify it).
        A reader without `call_keys` finds the call through `rollout_id`, its rollout."""

        def run() -> array[int]:
            if rollout_id is not None and not self._call_keys and self._refs.get(key) is None:
                self._rollout_refs(rollout_id)  # its calls' refs, the parent chain among them
            return self._full(key)

        return self._read(run)

    # -- StagingSource --------------------------------------------------------------------------

    def rollouts(self) -> list[str]:
        def run() -> list[str]:
            ids = [r for r in self._headed_rollouts() if r != PROXY_STATE_ROLLOUT]
            seen = set(ids)
            return ids + [r for r in self._rollouts_with_calls() if r not in seen]

        return self._read(run)

    def rollout_info(self, rollout_id: str) -> RolloutInfo:
        return self._read(lambda: self._info(rollout_id))

    def _info(self, rollout_id: str) -> RolloutInfo:
        ledger = self._ledger_of(rollout_id)
        if rollout_id not in ledger.rollouts:
            raise KeyError(rollout_id)
        # An orphan mark names its call's rollout when the writer knew it (always, unless
        # the mark came before the record); only then are the rollout's calls read.
        marks = ledger.orphans
        here = any(marked_in == rollout_id for marked_in, _ in marks.values())
        if not here and any(marked_in is None for marked_in, _ in marks.values()):
            here = any(k in marks for k, _ in self._rollout_refs(rollout_id))
        return ledger.info(rollout_id, here)

    def _index_row(self, rollout_id: str) -> IndexedRollout:
        try:
            return row_of(self._info(rollout_id))
        except KeyError:  # calls without a header yet (or a store written before headers)
            return IndexedRollout(rollout_id, "open", False, 0, None, None, False)

    def indexed_rollouts(self, query: RolloutQuery) -> list[IndexedRollout]:
        """The rollouts `query` keeps, from the reader's rollout index (`_directory`): built at
        the first call (a header per rollout), then kept up to date with each new unit."""

        def run() -> list[IndexedRollout]:
            with self._directory_lock:
                if self._directory is None:
                    directory = Directory()
                    ids = [r for r in self._headed_rollouts() if r != PROXY_STATE_ROLLOUT]
                    seen = set(ids)
                    ids += [r for r in self._rollouts_with_calls() if r not in seen]
                    for rollout_id in ids:
                        directory.put(self._index_row(rollout_id))
                    self._directory = directory
                return self._directory.query(query)

        return self._read(run)

    def consumer_cursors(self) -> ParquetCursors:
        """The consumers' cursors of this dataset (`capture_proxy.sinks.cursors`)."""
        return ParquetCursors(self.dfs)

    def calls(self, rollout_id: str, *, include_orphaned: bool = False) -> list[StagedCallRecord]:
        def run() -> list[StagedCallRecord]:
            refs = self._rollout_refs(rollout_id)
            if not include_orphaned:
                orphans = self._orphans()
                refs = [(k, r) for k, r in refs if k not in orphans]
            refs.sort(key=lambda kr: kr[1].seq)
            return [self._record(k, r) for k, r in refs]

        return self._read(run)

    def failures(self, rollout_id: str) -> list[LedgerEntry]:
        return self._read(lambda: self._ledger_of(rollout_id).failures_of(rollout_id))

    def events(self, rollout_id: str) -> list[RolloutEvent]:
        # In position order, as the protocol says, not commit order: with several writers, a
        # merged unit takes its last unit's order, so a writer's unit committed after the
        # compaction listed the units can sort before the merged unit holding its rollout's
        # earlier events. Stable: two events at one position (a fork) keep their commit order.
        def run() -> list[RolloutEvent]:
            events = self._ledger_of(rollout_id).events.get(rollout_id, ())
            return sorted(events, key=lambda e: e.position)

        return self._read(run)

    def claims(self, rollout_id: str) -> dict[int, str]:
        # The claim files are the authority (a unit holding the claim event may have failed
        # after its file was created): read them, not the events.
        return read_claims(self.dfs, rollout_id)

    def claim_counts(self) -> dict[str, ClaimCount]:
        """Every rollout's claim files, counted (`sinks.base.ClaimFiles`): one listing."""
        return claim_counts(self.dfs)

    def event_heads(self) -> dict[str, tuple[int, str]]:
        """Each rollout's last event as (position, hash): where a writer continues its chain."""

        def run() -> dict[str, tuple[int, str]]:
            # The highest position, not the last committed: see `events`.
            idx = self._index
            if isinstance(idx, Index):
                heads = {}
                for r, events in idx.ledger.events.items():
                    last = max(events, key=lambda e: e.position)
                    heads[r] = (last.position, last.hash)
                return heads
            collected = idx.heads
            if collected is not None:
                # Read while the units were indexed (the first call after the reader opened,
                # a writer's open); kept no longer: later calls read the ledger files again.
                idx.heads = None
                self._collect_heads = False
                return collected
            # A units index holds no events: one pass over the ledger files.
            heads = {}
            for files in idx.units:
                if LEDGER in files:
                    for row in read_table(self.dfs, files[LEDGER]).to_pylist():
                        if row["kind"] == "event":
                            head = (int(row["position"]), row["hash"])
                            if head[0] >= heads.get(row["rollout_id"], (-1, ""))[0]:
                                heads[row["rollout_id"]] = head
            return heads

        return self._read(run)

    def summaries(self, rollout_id: str) -> list[CallSummary]:
        def run() -> list[CallSummary]:
            orphans = self._orphans()
            out = []
            for k, ref in sorted(self._rollout_refs(rollout_id), key=lambda kr: kr[1].seq):
                cols, i = self._summary_of(ref.where), ref.where.row
                prompt_len = cols["prompt_len"][i]
                out.append(
                    CallSummary(
                        call_id=k,
                        seq=ref.seq,
                        parent_call_id=ref.parent_call_id,
                        retry_of=cols["retry_of"][i],
                        finish_reason=cols["finish_reason"][i],
                        prompt_len=prompt_len,
                        completion_len=ref.cum_len - prompt_len,
                        cum_len=ref.cum_len,
                        prev_len=ref.prev_len,
                        created_at_ms=cols["created_at_ms"][i],
                        weight_version=ref.weight_version,
                        orphaned=k in orphans,
                    )
                )
            return out

        return self._read(run)

    def fetch(self, keys: Sequence[str]) -> list[StagedCallRecord]:
        def run() -> list[StagedCallRecord]:
            refs = [(k, self._ref(k)) for k in keys]
            with self._read_ahead([r for _, r in refs if r is not None]):
                return [self._record(k, r) for k, r in refs]

        return self._read(run)

    def coords(self, keys: Sequence[str]) -> list[CommitCoords]:
        def one(k: str) -> CommitCoords:
            r = self._ref(k)
            if r is None:
                raise KeyError(k)
            return CommitCoords(
                self.url,
                k,
                r.digest,
                r.extras_digest,
                r.prev_len,
                r.delta_len,
                r.cum_len,
                r.weight_version,
            )

        return self._read(lambda: [one(k) for k in keys])

    def orphaned(self) -> set[str]:
        return self._read(lambda: set(self._orphans()))

    def all_keys(self) -> Iterable[str]:
        def run() -> list[str]:
            idx = self._index
            if isinstance(idx, Index):
                return list(idx.calls)
            # A units index keeps no call ids: read them (the first copy of an id wins).
            keys = dict.fromkeys(
                k
                for path in self._calls_files()
                for t in read_groups(self.dfs, path, ["call_id"])
                for k in t.column("call_id").to_pylist()
            )
            return list(keys)

        return self._read(run)

    def unreferenced_attachments(self) -> list[str]:
        """Attachments no call refers to, leaving out those committed less than
        ``DEDUP_WINDOW_S + GC_MARGIN_S`` ago: gc keeps those on purpose (a writer may still
        share them) and removes them once they are older (docs/storage.md, online gc)."""

        def run() -> list[str]:
            idx = self._index
            if not len(idx.attachments):
                return []
            if isinstance(idx, Index):
                used = {s for r in idx.calls.values() for s in r.attachment_shas}
            else:
                used = {
                    s
                    for path in self._calls_files()
                    for t in read_groups(self.dfs, path, ["attachment_shas"])
                    for shas in t.column("attachment_shas").to_pylist()
                    for s in shas or ()
                }
            young = time.time_ns() - int((DEDUP_WINDOW_S + GC_MARGIN_S) * 1e9)
            return sorted(
                sha
                for sha, path in self._attachment_files().items()
                if sha not in used and _order_of(path) <= young
            )

        return self._read(run)

    def close_reader(self) -> None:
        with self._rw.exclusive():
            self._clear_caches()
