"""`ParquetSource`: read a Parquet dataset back (the `StagingSource` protocol).

The reader keeps an index of the committed units (`_index`) and loads row groups only
when a record is asked for, with LRU caches for row groups and for full token sequences. Every
public call first re-lists the commit markers, so a reader sees commits made after it was
opened; when a compaction removed a file the reader had listed, the call re-lists and retries.

A reader may be shared between threads (the proxy shares one across its worker threads): its
calls are serialized by a lock, because two refreshes running at once would index the same unit
twice (and then re-index the whole dataset to repair it).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ...schemas.events import RolloutEvent
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
from ._claims import read_claims
from ._fs import DatasetFS
from ._index import LRU, CallRef, Index, Known, Where, ids_from_bytes
from ._layout import COMMITS_DIR, Marker, check_format, list_markers, live_units, read_group

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


def default_url(location: str) -> str:
    """The canonical store URL for a dataset location (what coordinates report)."""
    return location if "://" in location else f"parquet:///{location}"


class _Group:
    """A cached row group: the Arrow table, turned into Python rows on first use."""

    __slots__ = ("_rows", "nbytes", "table")

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.nbytes = int(table.nbytes) + _GROUP_OVERHEAD + _COLUMN_OVERHEAD * table.num_columns
        self._rows: list[dict[str, Any]] | None = None

    def row(self, i: int) -> dict[str, Any]:
        if self._rows is None:
            self._rows = self.table.to_pylist()
        return self._rows[i]


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
    ) -> None:
        self.url = url or default_url(location)
        self.dfs = dfs or DatasetFS(location, filesystem)
        if not check_format(self.dfs):
            raise StoreError(f"no capture-proxy Parquet dataset at {location}")
        self._lock = threading.RLock()
        self._markers: dict[str, Marker] = {}
        self._listing: list[str] = []
        self._index = Index()
        self._groups: LRU[tuple[str, int], _Group] = LRU(cache_bytes, lambda g: g.nbytes)
        self._fulls: LRU[str, array[int]] = LRU(cache_tokens, len)
        self._summary_columns: LRU[tuple[str, int], dict[str, list[Any]]] = LRU(
            _SUMMARY_CACHE_ROWS, lambda cols: len(cols["prompt_len"])
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
        for name in names:
            if name not in self._markers:
                try:
                    raw = self.dfs.read(f"{COMMITS_DIR}/{name}.json")
                except FileNotFoundError:
                    continue  # removed by a compaction's cleanup after it was listed
                self._markers[name] = Marker.decode(raw)
        for gone in set(self._markers) - set(names):
            del self._markers[gone]
        live = live_units(self._markers)
        old = self._index.units
        if live[: len(old)] == old:
            for unit in live[len(old) :]:
                self._index.add_unit(self.dfs, unit, self._keep)
        else:
            # A compaction replaced units: re-index, so ledger rows replay in the new order.
            index = Index()
            for unit in live:
                index.add_unit(self.dfs, unit, self._keep)
            self._index = index

    def _reset(self) -> None:
        self._listing = []
        self._markers = {}
        self._index = Index()

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
        seqs: dict[str, dict[int, str]] = {}
        for call_id, ref in idx.calls.items():
            seqs.setdefault(ref.rollout_id, {}).setdefault(ref.seq, call_id)
        for rollout_id, failures in idx.ledger.failures.items():
            held = seqs.setdefault(rollout_id, {})
            for f in failures:
                held.setdefault(f.seq, f.call_id)
        return Known(
            calls={k: r.rollout_id for k, r in idx.calls.items()},
            seqs=seqs,
            blobs=set(idx.blobs),
            attachments=set(idx.attachments),
            rollouts=set(idx.ledger.rollouts) | set(idx.by_rollout),
            last_order=max((m.order for m in self._markers.values()), default=0),
        )

    # -- loading --------------------------------------------------------------------------------

    def _row(self, where: Where) -> dict[str, Any]:
        key = (where.path, where.group)
        group = self._groups.get(key)
        if group is None:
            group = self._groups.put(key, _Group(read_group(self.dfs, where.path, where.group)))
        return group.row(where.row)

    def _keep(self, key: tuple[str, int], table: pa.Table) -> None:
        self._groups.put(key, _Group(table))

    def _blob(self, key: str) -> bytes:
        data: bytes = self._row(self._index.blobs[key])["data"]
        return data

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
            ref = self._index.calls.get(cid)
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

    def _record(self, key: str) -> StagedCallRecord:
        ref = self._index.calls[key]
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
            return ids + [r for r in self._index.by_rollout if r not in seen]

        return self._read(run)

    def rollout_info(self, rollout_id: str) -> RolloutInfo:
        def run() -> RolloutInfo:
            here = False
            for call_id, (marked_in, _) in self._index.ledger.orphans.items():
                ref = self._index.calls.get(call_id)
                here = here or (ref.rollout_id if ref else marked_in) == rollout_id
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

    def events(self, rollout_id: str) -> list[RolloutEvent]:
        return self._read(lambda: list(self._index.ledger.events.get(rollout_id, ())))

    def claims(self, rollout_id: str) -> dict[int, str]:
        # The claim files are the authority (a unit holding the claim event may have failed
        # after its file was created): read them, not the events.
        return read_claims(self.dfs, rollout_id)

    def event_heads(self) -> dict[str, tuple[int, str]]:
        """Each rollout's last event as (position, hash): where a writer continues its chain."""

        def run() -> dict[str, tuple[int, str]]:
            return {r: (e[-1].position, e[-1].hash) for r, e in self._index.ledger.events.items()}

        return self._read(run)

    def summaries(self, rollout_id: str) -> list[CallSummary]:
        def run() -> list[CallSummary]:
            calls, orphans = self._index.calls, self._index.ledger.orphans
            keys = sorted(self._index.by_rollout.get(rollout_id, []), key=lambda k: calls[k].seq)
            out = []
            for k in keys:
                ref = calls[k]
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
            r = self._index.calls[k]
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
        return self._read(lambda: list(self._index.calls))

    def unreferenced_attachments(self) -> list[str]:
        def run() -> list[str]:
            used = {s for r in self._index.calls.values() for s in r.attachment_shas}
            return sorted(set(self._index.attachments) - used)

        return self._read(run)

    def close_reader(self) -> None:
        with self._lock:
            self._groups.clear()
            self._fulls.clear()
            self._summary_columns.clear()
