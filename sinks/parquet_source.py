"""`ParquetSource`: read a Parquet dataset back (the `StagingSource` protocol).

The reader keeps a small index of the committed units (call ids, lineage, digests: a few columns
of each file) and loads whole files only when a record is asked for, with LRU caches for files
and for full token sequences. Every public call first re-lists the commit markers, so a reader
sees commits made after it was opened; when a compaction removed a file the reader had listed,
the call re-lists and retries once.

A reader is not thread-safe; open one per thread.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..schemas.records import Attachment, CommitCoords, LedgerEntry, RolloutInfo, StagedCallRecord
from .base import StoreError
from .codec import decode_row
from .parquet_fs import DatasetFS
from .parquet_layout import (
    ATTACHMENTS,
    BLOBS,
    CALLS,
    LEDGER,
    Marker,
    check_format,
    list_markers,
    live_units,
    read_table,
)
from .parquet_ledger import Ledger

__all__ = ["LRU", "Known", "ParquetSource", "default_url", "ids_from_bytes"]

T = TypeVar("T")
_LITTLE = sys.byteorder == "little"

#: The columns of a calls file the index reads (everything else is loaded on demand).
_INDEX_COLUMNS = (
    "call_id",
    "rollout_id",
    "seq",
    "parent_call_id",
    "prev_len",
    "delta_len",
    "cum_len",
    "digest",
    "extras_digest",
    "weight_version",
    "attachment_shas",
)


def default_url(location: str) -> str:
    """The canonical store URL for a dataset location (what coordinates report)."""
    return location if "://" in location else f"parquet:///{location}"


def ids_from_bytes(data: bytes) -> array[int]:
    """Little-endian int32 bytes (the codec's token encoding) as an array."""
    a = array("i")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a


@dataclass(frozen=True, slots=True)
class CallRef:
    """Where a staged call's row is, and what coordinates and lineage need without loading it."""

    path: str
    row: int
    rollout_id: str
    seq: int
    parent_call_id: str | None
    prev_len: int
    delta_len: int
    cum_len: int
    digest: str
    extras_digest: str
    weight_version: int
    attachment_shas: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Rows:
    rows: list[dict[str, Any]]
    nbytes: int


@dataclass(slots=True)
class _Index:
    units: list[Marker] = field(default_factory=list)
    calls: dict[str, CallRef] = field(default_factory=dict)
    by_rollout: dict[str, list[str]] = field(default_factory=dict)
    blobs: dict[str, tuple[str, int]] = field(default_factory=dict)
    attachments: dict[str, tuple[str, int]] = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)


@dataclass(slots=True)
class Known:
    """What a writer must know of a dataset to append to it (duplicates, dedup, lineage)."""

    calls: dict[str, str]  # call id -> rollout id
    blobs: set[str]
    attachments: set[str]
    rollouts: set[str]
    last_order: int


class LRU(Generic[T]):
    """Least-recently-used values, evicted once their total weight exceeds `budget`."""

    def __init__(self, budget: int, weigh: Callable[[T], int]) -> None:
        self.budget = budget
        self.weigh = weigh
        self.weight = 0
        self._items: OrderedDict[str, tuple[T, int]] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> T | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, value: T) -> T:
        old = self._items.pop(key, None)
        if old is not None:
            self.weight -= old[1]
        w = self.weigh(value)
        self._items[key] = (value, w)
        self.weight += w
        while self.weight > self.budget and len(self._items) > 1:
            _, (_, evicted) = self._items.popitem(last=False)
            self.weight -= evicted
        return value

    def get_or(self, key: str, load: Callable[[], T]) -> T:
        value = self.get(key)
        return self.put(key, load()) if value is None else value

    def clear(self) -> None:
        self._items.clear()
        self.weight = 0


class ParquetSource:
    """Reads the dataset at `location` (a folder path or a pyarrow filesystem URL).

    Raises `StoreError` when there is no dataset there and `StoreFormatError` when it was
    written by a newer capture-proxy.
    """

    def __init__(
        self,
        location: str,
        *,
        url: str | None = None,
        cache_bytes: int = 256 << 20,
        cache_tokens: int = 4_000_000,
        dfs: DatasetFS | None = None,
    ) -> None:
        self.url = url or default_url(location)
        self.dfs = dfs or DatasetFS(location)
        if not check_format(self.dfs):
            raise StoreError(f"no capture-proxy Parquet dataset at {location}")
        self._markers: dict[str, Marker] = {}
        self._listing: list[str] = []
        self._index = _Index()
        # Decoded rows of whole files (records and blobs are read a file at a time) and rebuilt
        # full sequences (each child is its parent's prefix plus a delta).
        self._files: LRU[_Rows] = LRU(cache_bytes, lambda r: r.nbytes)
        self._fulls: LRU[array[int]] = LRU(cache_tokens, len)

    # -- snapshot -------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Pick up units committed (or retired) since the last call."""
        names = list_markers(self.dfs)
        if names == self._listing:
            return
        for name in names:
            if name not in self._markers:
                try:
                    self._markers[name] = Marker.decode(self.dfs.read(f"_commits/{name}.json"))
                except FileNotFoundError:
                    continue  # deleted by a compaction's cleanup after it was listed
        for gone in set(self._markers) - set(names):
            del self._markers[gone]
        live = live_units(self._markers)
        old = self._index.units
        if live[: len(old)] == old:
            for unit in live[len(old) :]:
                self._add_unit(self._index, unit)
        else:
            # A compaction replaced units: re-index, so ledger rows replay in the new order.
            index = _Index()
            for unit in live:
                self._add_unit(index, unit)
            self._index = index
        self._listing = names

    def _add_unit(self, index: _Index, unit: Marker) -> None:
        files = unit.files
        if CALLS in files:
            t = read_table(self.dfs, files[CALLS], _INDEX_COLUMNS).to_pydict()
            for i, cid in enumerate(t["call_id"]):
                if cid in index.calls:
                    continue  # a second copy (e.g. two writers): the first committed wins
                ref = CallRef(
                    files[CALLS],
                    i,
                    t["rollout_id"][i],
                    t["seq"][i],
                    t["parent_call_id"][i],
                    t["prev_len"][i],
                    t["delta_len"][i],
                    t["cum_len"][i],
                    t["digest"][i],
                    t["extras_digest"][i],
                    t["weight_version"][i],
                    tuple(t["attachment_shas"][i] or ()),
                )
                index.calls[cid] = ref
                index.by_rollout.setdefault(ref.rollout_id, []).append(cid)
        if BLOBS in files:
            keys = read_table(self.dfs, files[BLOBS], ["key"]).column("key").to_pylist()
            for i, k in enumerate(keys):
                index.blobs.setdefault(k, (files[BLOBS], i))
        if ATTACHMENTS in files:
            shas = read_table(self.dfs, files[ATTACHMENTS], ["sha256"]).column(0).to_pylist()
            for i, s in enumerate(shas):
                index.attachments.setdefault(s, (files[ATTACHMENTS], i))
        if LEDGER in files:
            index.ledger.apply(read_table(self.dfs, files[LEDGER]).to_pylist())
        index.units.append(unit)

    def known(self) -> Known:
        """Everything a writer appending to this dataset must know (see `ParquetSink`)."""
        self.refresh()
        idx = self._index
        return Known(
            calls={k: r.rollout_id for k, r in idx.calls.items()},
            blobs=set(idx.blobs),
            attachments=set(idx.attachments),
            rollouts=set(idx.ledger.rollouts) | set(idx.by_rollout),
            last_order=max((m.order for m in self._markers.values()), default=0),
        )

    def _read(self, fn: Callable[[], T]) -> T:
        """Run a read against a fresh snapshot; if a file vanished under it, re-list and retry."""
        self.refresh()
        try:
            return fn()
        except FileNotFoundError:
            self._listing = []
            self.refresh()
            return fn()

    # -- loading --------------------------------------------------------------------------------

    def _rows(self, path: str) -> list[dict[str, Any]]:
        def load() -> _Rows:
            table = read_table(self.dfs, path)
            return _Rows(table.to_pylist(), table.nbytes)

        return self._files.get_or(path, load).rows

    def ref(self, key: str) -> CallRef:
        """The index entry of a staged call (KeyError if absent); no refresh."""
        return self._index.calls[key]

    def row(self, key: str) -> dict[str, Any]:
        ref = self._index.calls[key]
        return self._rows(ref.path)[ref.row]

    def blob(self, key: str) -> bytes:
        path, i = self._index.blobs[key]
        data: bytes = self._rows(path)[i]["data"]
        return data

    def attachment(self, sha: str) -> Attachment | None:
        where = self._index.attachments.get(sha)
        if where is None:
            return None
        r = self._rows(where[0])[where[1]]
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
            ref = self._index.calls.get(cid)
            if ref is None:
                if cid == key:
                    raise KeyError(key)
                raise ValueError(f"{key}: its ancestor {cid} is missing from the dataset")
            chain.append((cid, ref))
            cid = ref.parent_call_id if ref.prev_len else None
        for cid, ref in reversed(chain):
            delta = ids_from_bytes(self._rows(ref.path)[ref.row]["delta_tokens"])
            if ref.prev_len:
                if base is None or len(base) < ref.prev_len:
                    raise ValueError(f"{cid}: needs {ref.prev_len} tokens of its parent")
                seq = base[: ref.prev_len]
                seq.extend(delta)
            else:
                seq = delta
            base = self._fulls.put(cid, seq)
        if base is None:
            raise KeyError(key)
        return base

    def _record(self, key: str) -> StagedCallRecord:
        ref = self._index.calls[key]
        row = self._rows(ref.path)[ref.row]
        parent = self._full(ref.parent_call_id) if ref.prev_len and ref.parent_call_id else None
        atts = [a for s in ref.attachment_shas if (a := self.attachment(s)) is not None]
        record, full = decode_row(row, self.blob, parent, atts)
        self._fulls.put(key, full)
        return record

    # -- StagingSource --------------------------------------------------------------------------

    def rollouts(self) -> list[str]:
        def run() -> list[str]:
            ids = list(self._index.ledger.rollouts)
            seen = set(ids)
            return ids + [r for r in self._index.by_rollout if r not in seen]

        return self._read(run)

    def rollout_info(self, rollout_id: str) -> RolloutInfo:
        def run() -> RolloutInfo:
            orphans = self._index.ledger.orphans
            here = any(
                (r.rollout_id if (r := self._index.calls.get(c)) else rid) == rollout_id
                for c, (rid, _) in orphans.items()
            )
            return self._index.ledger.info(rollout_id, here)

        return self._read(run)

    def calls(self, rollout_id: str, *, include_orphaned: bool = False) -> list[StagedCallRecord]:
        def run() -> list[StagedCallRecord]:
            keys = self._index.by_rollout.get(rollout_id, [])
            if not include_orphaned:
                keys = [k for k in keys if k not in self._index.ledger.orphans]
            keys = sorted(keys, key=lambda k: self._index.calls[k].seq)
            return [self._record(k) for k in keys]

        return self._read(run)

    def failures(self, rollout_id: str) -> list[LedgerEntry]:
        return self._read(lambda: self._index.ledger.failures_of(rollout_id))

    def fetch(self, keys: Sequence[str]) -> list[StagedCallRecord]:
        return self._read(lambda: [self._record(k) for k in keys])

    def coords(self, keys: Sequence[str]) -> list[CommitCoords]:
        def run() -> list[CommitCoords]:
            out = []
            for k in keys:
                r = self._index.calls[k]
                out.append(
                    CommitCoords(
                        self.url,
                        k,
                        r.digest,
                        r.extras_digest,
                        r.prev_len,
                        r.delta_len,
                        r.cum_len,
                        r.weight_version,
                    )
                )
            return out

        return self._read(run)

    def orphaned(self) -> set[str]:
        return self._read(lambda: set(self._index.ledger.orphans))

    def all_keys(self) -> Iterable[str]:
        return self._read(lambda: list(self._index.calls))

    def unreferenced_attachments(self) -> list[str]:
        def run() -> list[str]:
            used = {s for r in self._index.calls.values() for s in r.attachment_shas}
            return sorted(set(self._index.attachments) - used)

        return self._read(run)

    def close_reader(self) -> None:
        self._files.clear()
        self._fulls.clear()
