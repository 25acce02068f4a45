"""How a `ParquetSource` loads what it reads: row groups, call refs, blobs, full sequences, and
a rollout's ledger rows (a units index holds none).

`Loading` is the reader's half that goes from its index (`_index.Index` or `_index.UnitIndex`)
to rows, with the LRU caches that make repeated reads cheap; `ParquetSource` (`_source`) owns the
snapshot (markers, refresh, the lock) and the public reads.
"""

from __future__ import annotations

import contextlib
import threading
from array import array
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa

from ...schemas.records import Attachment, StagedCallRecord
from ..codec import decode_row
from ._fs import DatasetFS
from ._index import (
    INDEX_COLUMNS,
    LRU,
    CallRef,
    Index,
    UnitIndex,
    Where,
    call_ref,
    ids_from_bytes,
)
from ._layout import ATTACHMENTS, BLOBS, CALLS, LEDGER, read_group, read_groups, read_table
from ._ledger import LedgerState

__all__ = [
    "INDEX_GROUP_ROWS",
    "LEDGER_CACHE_ROWS",
    "RECENT_REFS",
    "SUMMARY_CACHE_ROWS",
    "SUMMARY_COLUMNS",
    "Loading",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
#: What `summaries` reads beyond the index: a few scalar columns, never tokens or messages.
SUMMARY_COLUMNS = ("retry_of", "finish_reason", "prompt_len", "created_at_ms")
#: Rows of those columns kept between calls (an overview reads every rollout of a row group).
SUMMARY_CACHE_ROWS = 1 << 18
#: What a cached row group costs beyond its Arrow buffers (`nbytes`), per group and per column:
#: the C++ table, array and buffer objects and the allocator's rounding. Measured on small
#: groups (4 calls, 26 columns): about 58 KB of RSS each against 10 KB of `nbytes`; a cache
#: weighed by `nbytes` alone held five times its budget.
_GROUP_OVERHEAD = 4096
_COLUMN_OVERHEAD = 2048
#: A units index's caches: the index columns of row groups (in rows: about 0.6 KB of Python
#: objects each) and the call refs looked up lately (a resume reads each call a few times).
INDEX_GROUP_ROWS = 8192
RECENT_REFS = 8192
#: A units index's cache of ledger files, in rows (about 1.5 KB of Python objects each): a
#: resume or a manifest reads a rollout's header, failures and events from the same few files.
LEDGER_CACHE_ROWS = 2048
#: Row groups of one rollout's records read at once (`Loading._read_ahead`).
READ_AHEAD_WORKERS = 8


class _Group:
    """A cached row group: the Arrow table, turned into Python rows on first use."""

    __slots__ = ("_keys", "_one", "_rows", "nbytes", "table")

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.nbytes = int(table.nbytes) + _GROUP_OVERHEAD + _COLUMN_OVERHEAD * table.num_columns
        self._rows: list[dict[str, Any]] | None = None
        self._one: dict[int, dict[str, Any]] = {}
        self._keys: dict[str, int] | None = None

    def row(self, i: int) -> dict[str, Any]:
        if self._rows is not None:
            return self._rows[i]
        # One row at a time until half the group was asked for: a rollout's reads take a row
        # or two of a unit's groups (its calls, its blobs), not the other rollouts' rows.
        one = self._one.get(i)
        if one is None:
            one = self._one[i] = self.table.slice(i, 1).to_pylist()[0]
            if 2 * len(self._one) > self.table.num_rows:
                self._rows = self.table.to_pylist()
                self._one = {}
        return one

    def find(self, column: str, key: str) -> int | None:
        """The first row whose `column` is `key`."""
        if self._keys is None:
            keys: dict[str, int] = {}
            for i, k in enumerate(self.table.column(column).to_pylist()):
                keys.setdefault(k, i)
            self._keys = keys
        return self._keys.get(key)


class Loading:
    """Loads rows for the index it is given; see the module docstring."""

    dfs: DatasetFS
    _index: Index | UnitIndex
    _groups: LRU[tuple[str, int], _Group]
    _fulls: LRU[str, array[int]]
    _summary_columns: LRU[tuple[str, int], dict[str, list[Any]]]
    _index_groups: LRU[tuple[str, int], dict[str, list[Any]]]
    _refs: LRU[str, CallRef]
    _ledger_files: LRU[str, list[dict[str, Any]]]
    #: A units index keeps a key per call (`UnitIndex.calls`) ...
    _call_keys: bool
    #: ... or starts to, the first time a call is read by a key it has not read lately.
    _keys_on_demand: bool

    def _caches(self, cache_bytes: int, cache_tokens: int, per_unit: bool) -> None:
        self._index_groups = LRU(INDEX_GROUP_ROWS, lambda cols: 16 + len(cols["call_id"]))
        self._ledger_files = LRU(LEDGER_CACHE_ROWS, lambda rows: 16 + len(rows))
        self._refs = LRU(RECENT_REFS, lambda _: 1)
        self._groups = LRU(cache_bytes, lambda g: g.nbytes)
        self._fulls = LRU(cache_tokens, len)
        #: Per thread: row groups read ahead for the records it is reading (`_read_ahead`).
        self._pinned = threading.local()
        self._summary_columns = LRU(
            INDEX_GROUP_ROWS if per_unit else SUMMARY_CACHE_ROWS,
            lambda cols: 16 + len(cols["prompt_len"]),
        )

    def _clear_caches(self) -> None:
        self._groups.clear()
        self._fulls.clear()
        self._summary_columns.clear()
        self._index_groups.clear()
        self._refs.clear()
        self._ledger_files.clear()

    def _rollouts_with_calls(self) -> Iterable[str]:
        idx = self._index
        if isinstance(idx, Index):
            return idx.by_rollout
        if idx.ids_complete:
            return list(idx.rollout_units)  # (a copy: units are indexed while it is read)
        # Sealed rollouts are not kept by id: read the ids (as `all_keys` reads call ids).
        return dict.fromkeys(
            r
            for path in self._calls_files()
            for t in read_groups(self.dfs, path, ["rollout_id"])
            for r in t.column("rollout_id").to_pylist()
        )

    def _index_group(self, path: str, group: int) -> dict[str, list[Any]]:
        """`INDEX_COLUMNS` of a calls row group, as lists (cached)."""
        key = (path, group)
        cols = self._index_groups.get(key)
        if cols is None:
            cached = self._groups.get(key)
            if cached is not None:
                table = cached.table.select(list(INDEX_COLUMNS))
            else:
                table = read_group(self.dfs, path, group, INDEX_COLUMNS)
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
        calls = idx.calls
        if calls is None:
            if not self._keys_on_demand:
                # Without call keys a call is found through its rollout (`ParquetSource.full`).
                return None
            # A read by key of a call not read lately (a trainer's fetch through the proxy):
            # from now on this reader keeps a key per call. The flags change only once the
            # keys are built: a read that fails meanwhile leaves the reader as it was.
            calls = idx.key_calls(self.dfs)
            self._call_keys, self._keys_on_demand = True, False
        for u, g in calls.find(key):
            path = idx.units[u][CALLS]
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
        places = [(idx.units[p >> 32][CALLS], p & 0xFFFFFFFF) for p in idx.units_of(rollout_id)]
        ahead = self._many(
            [p for p in places if p not in self._index_groups],
            lambda p: read_group(self.dfs, p[0], p[1], INDEX_COLUMNS).to_pydict(),
        )
        for path, g in places:
            cols = ahead.get((path, g))
            if cols is not None:
                self._index_groups.put((path, g), cols)
            else:
                cols = self._index_group(path, g)
            for i, rid in enumerate(cols["rollout_id"]):
                cid = cols["call_id"][i]
                if rid == rollout_id and cid not in seen:
                    seen.add(cid)
                    out.append((cid, self._refs.put(cid, call_ref(cols, i, Where(path, g, i)))))
        return out

    def _ledger_of(self, rollout_id: str) -> LedgerState:
        """The ledger as far as `rollout_id` goes: its header, failures and events (and every
        orphan mark). A calls index holds the whole ledger; a units index replays the
        rollout's rows from the ledger files of its units."""
        idx = self._index
        if isinstance(idx, Index):
            return idx.ledger
        state = LedgerState()
        state.orphans = dict(idx.orphans)  # (a copy: units are indexed while it is read)
        paths = [idx.units[packed >> 1][LEDGER] for packed in idx.ledger_units_of(rollout_id)]
        ahead = self._many(
            [p for p in paths if p not in self._ledger_files],
            lambda p: read_table(self.dfs, p).to_pylist(),
        )
        for path in paths:
            rows = ahead.get(path)
            if rows is not None:
                self._ledger_files.put(path, rows)
            else:
                rows = self._ledger_rows(path)
            state.apply(r for r in rows if r["rollout_id"] == rollout_id and r["kind"] != "orphan")
        return state

    def _many(self, keys: Sequence[K], read: Callable[[K], V]) -> dict[K, V]:
        """`read` of each of `keys`, at once on object storage ({} for fewer than two, or on
        a local folder: the caller reads them as it goes). A rollout's rows are in as many
        units as it has calls: each a request or two, made one after the other otherwise."""
        if self.dfs.local or len(keys) < 2:
            return {}
        with ThreadPoolExecutor(min(READ_AHEAD_WORKERS, len(keys))) as pool:
            return dict(zip(keys, pool.map(read, keys), strict=True))

    def _ledger_rows(self, path: str) -> list[dict[str, Any]]:
        """Every row of a ledger file (cached)."""
        rows = self._ledger_files.get(path)
        if rows is None:
            rows = self._ledger_files.put(path, read_table(self.dfs, path).to_pylist())
        return rows

    def _orphans(self) -> dict[str, tuple[str | None, str]]:
        idx = self._index
        return idx.ledger.orphans if isinstance(idx, Index) else idx.orphans

    def _headed_rollouts(self) -> list[str]:
        """The rollouts with a header in the ledger, in order of first appearance."""
        idx = self._index
        if isinstance(idx, Index):
            return list(idx.ledger.rollouts)
        if idx.ids_complete:
            held_by = list(idx.rollout_ledger.items())  # (units are indexed while it is read)
            return [r for r, held in held_by if any(p & 1 for p in held)]
        # Sealed rollouts are not kept by id: read the ids of the header rows.
        headed: dict[str, None] = {}
        for files in idx.units:
            if LEDGER in files:
                cols = read_table(self.dfs, files[LEDGER], ["kind", "rollout_id"]).to_pydict()
                for kind, rid in zip(cols["kind"], cols["rollout_id"], strict=True):
                    if kind == "rollout":
                        headed[rid] = None
        return list(headed)

    def _calls_files(self) -> list[str]:
        return [u[CALLS] for u in self._index.units if CALLS in u]

    # -- loading --------------------------------------------------------------------------------

    def _row(self, where: Where) -> dict[str, Any]:
        return self._group(where.path, where.group).row(where.row)

    def _group(self, path: str, g: int) -> _Group:
        key = (path, g)
        pinned: dict[tuple[str, int], _Group] | None = getattr(self._pinned, "groups", None)
        group = None if pinned is None else pinned.get(key)
        if group is None:
            group = self._groups.get(key)
        if group is None:
            group = self._groups.put(key, _Group(read_group(self.dfs, path, g)))
        return group

    @contextlib.contextmanager
    def _read_ahead(self, refs: Sequence[CallRef]) -> Iterator[None]:
        """Read the row groups `_record` reads for `refs` (their rows, then the blobs those
        rows name) at once, on object storage, and keep them for this thread until the block
        ends: a rollout's calls are in as many units as it has calls, each a request or two,
        and a resume reads them all. Kept aside from the shared cache, which reads of other
        rollouts on other threads may evict them from meanwhile."""
        if self.dfs.local or len(refs) < 2:
            yield
            return
        pinned: dict[tuple[str, int], _Group] = {}
        self._load_groups(pinned, ((r.where.path, r.where.group) for r in refs))
        places = []
        for r in refs:
            row = pinned[(r.where.path, r.where.group)].row(r.where.row)
            keys = row.get("message_keys") or b""
            names = [keys[i : i + 32].hex() for i in range(0, len(keys), 32)]
            for key in [*names, str(row.get("request_key"))]:
                place = self._blob_place(key)
                if place is not None:
                    places.append(place)
        self._load_groups(pinned, places)
        self._pinned.groups = pinned
        try:
            yield
        finally:
            self._pinned.groups = None

    def _load_groups(
        self, into: dict[tuple[str, int], _Group], places: Iterable[tuple[str, int]]
    ) -> None:
        wanted = [p for p in dict.fromkeys(places) if p not in into]
        cached = {p: g for p in wanted if (g := self._groups.get(p)) is not None}
        into.update(cached)
        wanted = [p for p in wanted if p not in cached]
        if not wanted:
            return
        with ThreadPoolExecutor(min(READ_AHEAD_WORKERS, len(wanted))) as pool:
            tables = pool.map(lambda p: read_group(self.dfs, *p), wanted)
            for place, table in zip(wanted, tables, strict=True):
                into[place] = self._groups.put(place, _Group(table))

    def _blob_place(self, key: str) -> tuple[str, int] | None:
        """The row group `_blob` looks in first for `key`."""
        idx = self._index
        if isinstance(idx, Index):
            where = idx.blobs.get(key)
            return None if where is None else (where.path, where.group)
        for u, g in idx.blobs.find(key, newest_first=True):
            return idx.units[u][BLOBS], g
        return None

    def _keep(self, key: tuple[str, int], table: pa.Table) -> None:
        self._groups.put(key, _Group(table))

    def _blob(self, key: str) -> bytes:
        idx = self._index
        if isinstance(idx, Index):
            data: bytes = self._row(idx.blobs[key])["data"]
            return data
        # Newest first: a blob is most often one a recent call stored (its own session's).
        for u, g in idx.blobs.find(key, newest_first=True):
            path = idx.units[u][BLOBS]
            group = self._group(path, g)
            i = group.find("key", key)
            if i is not None:
                found: bytes = group.row(i)["data"]
                return found
        raise KeyError(key)

    def _attachment(self, sha: str) -> Attachment | None:
        idx = self._index
        if isinstance(idx, Index):
            where = idx.attachments.get(sha)
            if where is None:
                return None
            r = self._row(where)
        else:
            for u, g in idx.attachments.find(sha):
                group = self._group(idx.units[u][ATTACHMENTS], g)
                i = group.find("sha256", sha)
                if i is not None:
                    r = group.row(i)
                    break
            else:
                return None
        return Attachment(r["sha256"], r["media_type"], r["data"])

    def _attachment_files(self) -> dict[str, str]:
        """Each attachment's sha256 -> the data file of its first copy. A units index reads
        the keys of every attachments file (a writer's open, gc)."""
        idx = self._index
        if isinstance(idx, Index):
            return {sha: w.path for sha, w in idx.attachments.items()}
        out: dict[str, str] = {}
        for files in idx.units:
            if ATTACHMENTS in files:
                path = files[ATTACHMENTS]
                for t in read_groups(self.dfs, path, ["sha256"]):
                    for sha in t.column("sha256").to_pylist():
                        out.setdefault(sha, path)
        return out

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
            if len(chain) > self._calls_bound():
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

    def _calls_bound(self) -> int:
        """More than a parent chain can hold (a longer one loops)."""
        calls = self._index.calls
        # Without call keys, a chain is one rollout's, whose calls are all among the refs.
        return len(self._refs) if calls is None else len(calls)

    def _summary_of(self, where: Where) -> dict[str, list[Any]]:
        """`SUMMARY_COLUMNS` of a row group: from a group cached whole, else a projected read."""
        key = (where.path, where.group)
        cols = self._summary_columns.get(key)
        if cols is None:
            group = self._groups.get(key)
            if group is not None:
                table = group.table.select(list(SUMMARY_COLUMNS))
            else:
                table = read_group(self.dfs, where.path, where.group, SUMMARY_COLUMNS)
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
