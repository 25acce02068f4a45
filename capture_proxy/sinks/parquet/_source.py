"""`ParquetSource`: read a Parquet dataset back (the `StagingSource` protocol).

The reader keeps an index of the committed units (`_index`) and loads row groups only
when a record is asked for, with LRU caches for row groups and for full token sequences. Every
public call first re-lists the commit markers, so a reader sees commits made after it was
opened; when a compaction removed a file the reader had listed, the call re-lists and retries.

A reader may be shared between threads (the proxy shares one across its worker threads): its
calls are serialized by a lock, because two refreshes running at once would index the same unit
twice (and then re-index the whole dataset to repair it).

``index="units"`` is for readers that live as long as a proxy and read a few rollouts at a time
(resume, manifests, the writer's own lookups): its memory follows the store's units and
rollouts, not every call and blob (`_index.UnitIndex`), and a rollout's calls are read from its
units when asked for. The default (``"calls"``) indexes every call, for bulk reads.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ...schemas.records import (
    Attachment,
    CallSummary,
    CommitCoords,
    LedgerEntry,
    RolloutInfo,
    StagedCallRecord,
)
from ..base import PROXY_STATE_ROLLOUT, StoreError
from ..codec import decode_row
from ._fs import DatasetFS
from ._index import (
    INDEX_COLUMNS,
    LRU,
    CallRef,
    Index,
    Known,
    UnitIndex,
    Where,
    call_ref,
    ids_from_bytes,
)
from ._layout import (
    BLOBS,
    CALLS,
    COMMITS_DIR,
    Marker,
    check_format,
    list_markers,
    live_units,
    read_group,
    read_groups,
)

__all__ = ["ParquetSource", "default_url"]

T = TypeVar("T")
#: Reads retried when files vanish under them (each retry follows a compaction's cleanup).
_ATTEMPTS = 5
#: What `summaries` reads beyond the index: a few scalar columns, never tokens or messages.
_SUMMARY_COLUMNS = ("retry_of", "finish_reason", "prompt_len", "created_at_ms")
#: Rows of those columns kept between calls (an overview reads every rollout of a row group).
_SUMMARY_CACHE_ROWS = 1 << 18
#: What a cached row group costs beyond its Arrow buffers (`nbytes`), per group and per column:
#: the C++ table, array and buffer objects and the allocator's rounding. Measured on small
#: groups (4 calls, 26 columns): about 58 KB of RSS each against 10 KB of `nbytes`; a cache
#: weighed by `nbytes` alone held five times its budget.
_GROUP_OVERHEAD = 4096
_COLUMN_OVERHEAD = 2048
#: A units index's caches: the index columns of row groups (in rows: about 0.6 KB of Python
#: objects each) and the call refs looked up lately (a resume reads each call a few times).
_INDEX_GROUP_ROWS = 8192
_RECENT_REFS = 8192


def default_url(location: str) -> str:
    """The canonical store URL for a dataset location (what coordinates report)."""
    return location if "://" in location else f"parquet:///{location}"


class _Group:
    """A cached row group: the Arrow table, turned into Python rows on first use."""

    __slots__ = ("_keys", "_rows", "nbytes", "table")

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.nbytes = int(table.nbytes) + _GROUP_OVERHEAD + _COLUMN_OVERHEAD * table.num_columns
        self._rows: list[dict[str, Any]] | None = None
        self._keys: dict[str, int] | None = None

    def row(self, i: int) -> dict[str, Any]:
        if self._rows is None:
            self._rows = self.table.to_pylist()
        return self._rows[i]

    def find(self, column: str, key: str) -> int | None:
        """The first row whose `column` is `key`."""
        if self._keys is None:
            keys: dict[str, int] = {}
            for i, k in enumerate(self.table.column(column).to_pylist()):
                keys.setdefault(k, i)
            self._keys = keys
        return self._keys.get(key)


class ParquetSource:
    """Reads the dataset at `location` (a folder path or a pyarrow filesystem URL).

    Raises `StoreError` when there is no dataset there and `StoreFormatError` when it was
    written by a newer capture-proxy. `filesystem` is a configured pyarrow filesystem that
    `location` is a path in (object storage with credentials, say). `cache_bytes` bounds the
    decoded row groups kept (weighed by what they cost in memory, not just their buffers),
    `cache_tokens` the rebuilt full sequences (a child is its parent's prefix plus a delta).
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
    ) -> None:
        self.url = url or default_url(location)
        self.dfs = dfs or DatasetFS(location, filesystem)
        if not check_format(self.dfs):
            raise StoreError(f"no capture-proxy Parquet dataset at {location}")
        self._lock = threading.RLock()
        self._markers: dict[str, Marker] = {}
        self._listing: list[str] = []
        self._per_unit = index == "units"
        self._index: Index | UnitIndex = self._new_index()
        self._index_groups: LRU[tuple[str, int], dict[str, list[Any]]] = LRU(
            _INDEX_GROUP_ROWS, lambda cols: 16 + len(cols["call_id"])
        )
        self._refs: LRU[str, CallRef] = LRU(_RECENT_REFS, lambda _: 1)
        self._groups: LRU[tuple[str, int], _Group] = LRU(cache_bytes, lambda g: g.nbytes)
        self._fulls: LRU[str, array[int]] = LRU(cache_tokens, len)
        self._summary_columns: LRU[tuple[str, int], dict[str, list[Any]]] = LRU(
            _INDEX_GROUP_ROWS if self._per_unit else _SUMMARY_CACHE_ROWS,
            lambda cols: 16 + len(cols["prompt_len"]),
        )

    # -- snapshot -------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Pick up units committed (or retired) since the last call.

        Raises FileNotFoundError when a listed unit's files were deleted meanwhile (a compaction
        cleaning up); the reader is then reset, and the next refresh starts over.
        """
        with self._lock:
            names = list_markers(self.dfs)
            if names == self._listing:
                return
            try:
                self._load(names)
            except BaseException:
                self._reset()
                raise
            self._listing = names

    def _load(self, names: list[str]) -> None:
        listed = self._listing
        # The writer's steady state: names only appended (each refresh of a proxy's reader
        # would otherwise compare and sort every marker, a cost that grows with the store).
        appended = names[: len(listed)] == listed
        for name in names[len(listed) :] if appended else names:
            if name not in self._markers:
                try:
                    raw = self.dfs.read(f"{COMMITS_DIR}/{name}.json")
                except FileNotFoundError:
                    continue  # removed by a compaction's cleanup after it was listed
                self._markers[name] = Marker.decode(raw)
        if not appended:
            for gone in set(self._markers) - set(names):
                del self._markers[gone]
        fresh = names[len(listed) :]
        old = self._index.units
        if appended and all(n in self._markers and not self._markers[n].retires for n in fresh):
            # New units after the ones indexed, retiring none: they are the new live units.
            new = [self._markers[n] for n in fresh]
        else:
            live = live_units(self._markers)
            if live[: len(old)] == old:
                new = live[len(old) :]
            else:
                # A compaction replaced units: re-index, so ledger rows replay in the new order.
                self._index = self._new_index()
                self._refs.clear()
                self._index_groups.clear()
                new = live
        for unit in new:
            self._add_unit(unit)

    def _new_index(self) -> Index | UnitIndex:
        return UnitIndex() if self._per_unit else Index()

    def _add_unit(self, unit: Marker) -> None:
        if isinstance(self._index, UnitIndex):
            self._index.add_unit(self.dfs, unit)
        else:
            self._index.add_unit(self.dfs, unit, self._keep)

    def _reset(self) -> None:
        self._listing = []
        self._markers = {}
        self._index = self._new_index()
        self._refs.clear()
        self._index_groups.clear()

    def _read(self, fn: Callable[[], T]) -> T:
        """Run a read on a fresh snapshot; if a file vanished under it, re-list and retry.

        Files vanish only when a compaction deletes units it retired (after a grace period, or
        at once with ``grace_s=0``): re-listing finds the merged unit that replaced them.
        """
        with self._lock:
            for attempt in range(_ATTEMPTS):
                try:
                    self.refresh()
                    return fn()
                except FileNotFoundError:
                    self._reset()
                    if attempt == _ATTEMPTS - 1:
                        raise
        raise AssertionError("unreachable")

    def known(self) -> Known:
        """Everything a writer appending to this dataset must know (see `ParquetSink`)."""
        with self._lock:
            self.refresh()
            return self._known()

    def _known(self) -> Known:
        idx = self._index
        return Known(
            attachments=set(idx.attachments),
            rollouts=set(idx.ledger.rollouts) | set(self._rollouts_with_calls()),
            last_order=max((m.order for m in self._markers.values()), default=0),
        )

    def rollout_keys(self, rollout_id: str) -> tuple[set[str], dict[int, str]]:
        """A rollout's staged call ids, and which call holds each seq (staged or in the ledger;
        the first one holds it): what a writer checks a new call of the rollout against."""

        def run() -> tuple[set[str], dict[int, str]]:
            refs = self._rollout_refs(rollout_id)
            seqs: dict[int, str] = {}
            for call_id, ref in refs:
                seqs.setdefault(ref.seq, call_id)
            for f in self._index.ledger.failures.get(rollout_id, ()):
                seqs.setdefault(f.seq, f.call_id)
            return {k for k, _ in refs}, seqs

        return self._read(run)

    # -- the index, whichever kind ----------------------------------------------------------------

    def _rollouts_with_calls(self) -> Iterable[str]:
        idx = self._index
        return idx.rollout_units if isinstance(idx, UnitIndex) else idx.by_rollout

    def _index_group(self, path: str, group: int) -> dict[str, list[Any]]:
        """`INDEX_COLUMNS` of a calls row group, as lists (cached)."""
        key = (path, group)
        cols = self._index_groups.get(key)
        if cols is None:
            cached = self._groups.get(key)
            if cached is not None:
                table = cached.table.select(list(INDEX_COLUMNS))
            else:
                with self.dfs.open(path) as f:
                    table = pq.ParquetFile(f).read_row_group(
                        group, columns=list(INDEX_COLUMNS), use_threads=False
                    )
            cols = self._index_groups.put(key, table.to_pydict())
        return cols

    def _ref(self, key: str) -> CallRef | None:
        """Where a staged call is, and its index values (None: not staged)."""
        idx = self._index
        if isinstance(idx, Index):
            return idx.calls.get(key)
        ref = self._refs.get(key)
        if ref is not None:
            return ref
        for u, g in idx.calls.find(key):
            path = idx.units[u].files[CALLS]
            cols = self._index_group(path, g)
            try:
                i = cols["call_id"].index(key)
            except ValueError:
                continue  # another key with the same hash
            return self._refs.put(key, call_ref(cols, i, Where(path, g, i)))
        return None

    def _rollout_refs(self, rollout_id: str) -> list[tuple[str, CallRef]]:
        """A rollout's staged calls in commit order (the first copy of a call id wins)."""
        idx = self._index
        if isinstance(idx, Index):
            return [(k, idx.calls[k]) for k in idx.by_rollout.get(rollout_id, ())]
        out: list[tuple[str, CallRef]] = []
        seen: set[str] = set()
        for packed in idx.rollout_units.get(rollout_id, ()):
            path, g = idx.units[packed >> 32].files[CALLS], packed & 0xFFFFFFFF
            cols = self._index_group(path, g)
            for i, rid in enumerate(cols["rollout_id"]):
                cid = cols["call_id"][i]
                if rid == rollout_id and cid not in seen:
                    seen.add(cid)
                    out.append((cid, self._refs.put(cid, call_ref(cols, i, Where(path, g, i)))))
        return out

    def _calls_files(self) -> list[str]:
        return [u.files[CALLS] for u in self._index.units if CALLS in u.files]

    # -- loading --------------------------------------------------------------------------------

    def _row(self, where: Where) -> dict[str, Any]:
        return self._group(where.path, where.group).row(where.row)

    def _group(self, path: str, g: int) -> _Group:
        key = (path, g)
        group = self._groups.get(key)
        if group is None:
            group = self._groups.put(key, _Group(read_group(self.dfs, path, g)))
        return group

    def _keep(self, key: tuple[str, int], table: pa.Table) -> None:
        self._groups.put(key, _Group(table))

    def _blob(self, key: str) -> bytes:
        idx = self._index
        if isinstance(idx, Index):
            data: bytes = self._row(idx.blobs[key])["data"]
            return data
        # Newest first: a blob is most often one a recent call stored (its own session's).
        for u, g in idx.blobs.find(key, newest_first=True):
            path = idx.units[u].files[BLOBS]
            group = self._group(path, g)
            i = group.find("key", key)
            if i is not None:
                found: bytes = group.row(i)["data"]
                return found
        raise KeyError(key)

    def _attachment(self, sha: str) -> Attachment | None:
        where = self._index.attachments.get(sha)
        if where is None:
            return None
        r = self._row(where)
        return Attachment(r["sha256"], r["media_type"], r["data"])

    def full(self, key: str) -> array[int]:
        """A staged call's prompt + completion (shared with a cache: do not modify it)."""
        return self._read(lambda: self._full(key))

    def _full(self, key: str) -> array[int]:
        # Walk up to the nearest cached ancestor (or a root), then rebuild downwards: a parent
        # chain is as long as the session, so recursion would be the wrong tool.
        chain: list[tuple[str, CallRef]] = []
        base: array[int] | None = None
        cid: str | None = key
        while cid is not None:
            base = self._fulls.get(cid)
            if base is not None:
                break
            if len(chain) > len(self._index.calls):
                raise ValueError(f"{key}: its parent chain loops (a damaged dataset)")
            ref = self._ref(cid)
            if ref is None:
                if cid == key:
                    raise KeyError(key)
                raise ValueError(f"{key}: its ancestor {cid} is missing from the dataset")
            chain.append((cid, ref))
            cid = ref.parent_call_id if ref.prev_len else None
        for cid, ref in reversed(chain):
            delta = ids_from_bytes(self._row(ref.where)["delta_tokens"])
            if ref.prev_len:
                if base is None or len(base) < ref.prev_len:
                    raise ValueError(f"{cid}: needs {ref.prev_len} tokens of its parent")
                seq = base[: ref.prev_len]
                seq.extend(delta)
            else:
                seq = delta
            if len(seq) != ref.cum_len:
                raise ValueError(f"{cid}: rebuilt {len(seq)} tokens, stored as {ref.cum_len}")
            base = self._fulls.put(cid, seq)
        if base is None:
            raise KeyError(key)
        return base

    def _summary_of(self, where: Where) -> dict[str, list[Any]]:
        """`_SUMMARY_COLUMNS` of a row group: from a group cached whole, else a projected read."""
        key = (where.path, where.group)
        cols = self._summary_columns.get(key)
        if cols is None:
            group = self._groups.get(key)
            if group is not None:
                table = group.table.select(list(_SUMMARY_COLUMNS))
            else:
                with self.dfs.open(where.path) as f:
                    table = pq.ParquetFile(f).read_row_group(
                        where.group, columns=list(_SUMMARY_COLUMNS), use_threads=False
                    )
            cols = self._summary_columns.put(key, table.to_pydict())
        return cols

    def _record(self, key: str, ref: CallRef | None = None) -> StagedCallRecord:
        ref = ref or self._ref(key)
        if ref is None:
            raise KeyError(key)
        parent = self._full(ref.parent_call_id) if ref.prev_len and ref.parent_call_id else None
        atts = [a for s in ref.attachment_shas if (a := self._attachment(s)) is not None]
        record, full = decode_row(self._row(ref.where), self._blob, parent, atts)
        self._fulls.put(key, full)
        return record

    # -- StagingSource --------------------------------------------------------------------------

    def rollouts(self) -> list[str]:
        def run() -> list[str]:
            ids = [r for r in self._index.ledger.rollouts if r != PROXY_STATE_ROLLOUT]
            seen = set(ids)
            return ids + [r for r in self._rollouts_with_calls() if r not in seen]

        return self._read(run)

    def rollout_info(self, rollout_id: str) -> RolloutInfo:
        def run() -> RolloutInfo:
            ledger = self._index.ledger
            if rollout_id not in ledger.rollouts:
                raise KeyError(rollout_id)
            # An orphan mark names its call's rollout when the writer knew it (always, unless
            # the mark came before the record); only then are the rollout's calls read.
            marks = ledger.orphans
            here = any(marked_in == rollout_id for marked_in, _ in marks.values())
            if not here and any(marked_in is None for marked_in, _ in marks.values()):
                here = any(k in marks for k, _ in self._rollout_refs(rollout_id))
            return ledger.info(rollout_id, here)

        return self._read(run)

    def calls(self, rollout_id: str, *, include_orphaned: bool = False) -> list[StagedCallRecord]:
        def run() -> list[StagedCallRecord]:
            refs = self._rollout_refs(rollout_id)
            if not include_orphaned:
                refs = [(k, r) for k, r in refs if k not in self._index.ledger.orphans]
            refs.sort(key=lambda kr: kr[1].seq)
            return [self._record(k, r) for k, r in refs]

        return self._read(run)

    def failures(self, rollout_id: str) -> list[LedgerEntry]:
        return self._read(lambda: self._index.ledger.failures_of(rollout_id))

    def summaries(self, rollout_id: str) -> list[CallSummary]:
        def run() -> list[CallSummary]:
            orphans = self._index.ledger.orphans
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
        return self._read(lambda: [self._record(k) for k in keys])

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
        return self._read(lambda: set(self._index.ledger.orphans))

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
        def run() -> list[str]:
            idx = self._index
            if not idx.attachments:
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
            return sorted(set(idx.attachments) - used)

        return self._read(run)

    def close_reader(self) -> None:
        with self._lock:
            self._groups.clear()
            self._fulls.clear()
            self._summary_columns.clear()
            self._index_groups.clear()
            self._refs.clear()
