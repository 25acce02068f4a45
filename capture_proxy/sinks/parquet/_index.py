"""What a Parquet reader keeps in memory: an index of the live units, and LRU caches.

Two indexes, both built from a handful of columns of each file (opening a large dataset does not
read its token data):

* `Index` (a reader's default, for bulk reads) holds, per staged call, where its row is (file,
  row group, row) and the few values coordinates and lineage need; per blob and attachment,
  where its bytes are. About 1 KB per call: it grows with the store.
* `UnitIndex` (the proxy's long-lived readers) holds per unit which rollouts it has calls and
  ledger rows of, and per call and blob only an 8-byte hash, with the (unit, row group) it is
  in once per row group: about 9 bytes. A call's values are read from its row group when asked
  for, and a rollout's ledger (its header, failures and event log: two events or more per call)
  from its units' ledger files. Only live rollouts are kept by id: once a rollout's ``seal``
  event is indexed, where its rows are moves to a packed form filed under an 8-byte hash of its
  id (`Packed`: 16 bytes per rollout and about 2-3 per place, against about 0.4 KB per rollout
  of dicts and arrays), read when it is asked for. The hashes and packed places live in mapped
  temporary files once past 256 KiB (`_keyed`, `_spill`): its memory follows the units and the
  live rollouts of the store, not what they hold.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pyarrow as pa

from ._fs import DatasetFS
from ._keyed import Locator, Packed, key_hash
from ._layout import ATTACHMENTS, BLOBS, CALLS, LEDGER, Marker, read_groups, read_table
from ._ledger import LedgerState
from ._unit_names import UnitFileList

__all__ = [
    "INDEX_COLUMNS",
    "LEDGER_INDEX_COLUMNS",
    "LRU",
    "CallRef",
    "Index",
    "Known",
    "Locator",
    "Packed",
    "UnitIndex",
    "Where",
    "call_ref",
    "ids_from_bytes",
    "key_hash",
]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
#: Units up to this size (all their files) are read whole when indexed.
SMALL_UNIT_BYTES = 1 << 20
#: Receives a row group read while indexing: (path, group) and the table.
Keep = Callable[[tuple[str, int], pa.Table], None]
_LITTLE = sys.byteorder == "little"

#: The columns of a ledger file a `UnitIndex` reads.
LEDGER_INDEX_COLUMNS = ("kind", "rollout_id", "call_id", "reason", "event_kind", "state")
#: The same and what an event head is (`UnitIndex.heads`).
_LEDGER_HEAD_COLUMNS = (*LEDGER_INDEX_COLUMNS, "position", "hash")
#: The columns of a calls file the index reads (the rest is loaded on demand).
INDEX_COLUMNS = (
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


def ids_from_bytes(data: bytes) -> array[int]:
    """Little-endian int32 bytes (the codec's token encoding) as an array."""
    a = array("i")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a


@dataclass(frozen=True, slots=True)
class Where:
    """A row's place: data file, row group, row within the group."""

    path: str
    group: int
    row: int


@dataclass(frozen=True, slots=True)
class CallRef:
    """A staged call's row, and what coordinates and lineage need without loading it."""

    where: Where
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


def call_ref(t: dict[str, list[Any]], i: int, where: Where) -> CallRef:
    """Row `i` of `INDEX_COLUMNS` (as a pydict) as a `CallRef`."""
    # Interned: a rollout's calls share its id, a child its parent's id (a full index holds
    # every call, so a copy of each per call adds up).
    parent = t["parent_call_id"][i]
    return CallRef(
        where,
        sys.intern(t["rollout_id"][i]),
        t["seq"][i],
        None if parent is None else sys.intern(parent),
        t["prev_len"][i],
        t["delta_len"][i],
        t["cum_len"][i],
        t["digest"][i],
        t["extras_digest"][i],
        t["weight_version"][i],
        tuple(t["attachment_shas"][i] or ()),
    )


@dataclass(slots=True)
class Known:
    """What a writer must know of a whole dataset to append to it; what it must know of one
    rollout (its calls and seqs) it asks the reader for when the rollout comes back."""

    #: sha256 -> the order (commit time, ns) of the unit holding its first copy.
    attachments: dict[str, int]
    rollouts: set[str]
    last_order: int


@dataclass(slots=True)
class Index:
    """The live units of a snapshot, indexed. `add_unit` in commit order."""

    #: Each live unit's data files (`Marker.files`): a reader holds no more of its marker.
    units: UnitFileList = field(default_factory=UnitFileList)
    calls: dict[str, CallRef] = field(default_factory=dict)
    by_rollout: dict[str, list[str]] = field(default_factory=dict)
    blobs: dict[str, Where] = field(default_factory=dict)
    attachments: dict[str, Where] = field(default_factory=dict)
    ledger: LedgerState = field(default_factory=LedgerState)
    #: When not None, the rollouts `add_unit` met (calls or ledger rows) are added to it: the
    #: rollout index (`_directory`) looks at those again.
    touched: dict[str, None] | None = None

    def add_unit(self, dfs: DatasetFS, unit: Marker, keep: Keep | None = None) -> None:
        """Index `unit`. A small unit's files are read whole, once, and each row group handed to
        `keep` (the reader's cache): opening a small file costs more than reading all of it.
        """
        files = unit.files
        whole = keep is not None and unit.size <= SMALL_UNIT_BYTES

        def groups(path: str, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]]]:
            for g, t in enumerate(read_groups(dfs, path, None if whole else columns)):
                if whole and keep is not None:
                    keep((path, g), t)
                yield g, t.select(list(columns)).to_pydict()

        if CALLS in files:
            path = files[CALLS]
            for g, t in groups(path, INDEX_COLUMNS):
                for i, cid in enumerate(t["call_id"]):
                    if cid in self.calls:
                        continue  # a second copy (two writers): the first committed wins
                    ref = call_ref(t, i, Where(path, g, i))
                    cid = sys.intern(cid)
                    self.calls[cid] = ref
                    self.by_rollout.setdefault(ref.rollout_id, []).append(cid)
                    if self.touched is not None:
                        self.touched[ref.rollout_id] = None
        for table, column, into in (
            (BLOBS, "key", self.blobs),
            (ATTACHMENTS, "sha256", self.attachments),
        ):
            if table in files:
                path = files[table]
                for g, t in groups(path, [column]):
                    for i, key in enumerate(t[column]):
                        into.setdefault(key, Where(path, g, i))
        if LEDGER in files:
            rows = read_table(dfs, files[LEDGER]).to_pylist()
            self.ledger.apply(rows)
            if self.touched is not None:
                self.touched.update(
                    (r["rollout_id"], None) for r in rows if r["rollout_id"] is not None
                )
        self.units.append(unit.unit, files)


@dataclass(slots=True)
class UnitIndex:
    """The live units of a snapshot, indexed per unit (see the module docstring)."""

    #: Each live unit's data files (`Marker.files`), as in `Index.units` (packed: 15 bytes a
    #: unit, `_unit_names`).
    units: UnitFileList = field(default_factory=UnitFileList)
    #: rollout id -> the calls row groups holding its calls, ascending, each packed as one int
    #: (`unit << 32 | group`, unit a position in `units`): a few ints per rollout
    rollout_units: dict[str, array[int]] = field(default_factory=dict)
    #: None in a reader that finds calls by their rollout only (a writer's: `ParquetSource`'s
    #: `call_keys`), which saves 16 bytes per call of the store.
    calls: Locator | None = field(default_factory=Locator)
    blobs: Locator = field(default_factory=Locator)
    #: Where attachments are, as for blobs (the first copy of a sha256 is the one read); a
    #: writer that must know them all reads their keys at open (`ParquetSource.known`).
    attachments: Locator = field(default_factory=Locator)
    #: rollout id -> the units whose ledger files have rows of it (orphan marks aside),
    #: ascending, each packed as `unit << 1 | header` (header: one of them is a ``rollout``
    #: row). The rows themselves are read when asked for (`Loading._ledger_of`).
    rollout_ledger: dict[str, array[int]] = field(default_factory=dict)
    #: Orphan marks (rare, and `orphaned` lists them all): call id -> (rollout id, reason).
    orphans: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    #: Sealed rollouts' entries of `rollout_units` and `rollout_ledger`, moved out of them once
    #: the unit holding a rollout's ``seal`` event or a header saying it is sealed is indexed
    #: (a sealed rollout takes no more calls; the proxy writes its sealed header after the
    #: event, and an outcome later: each is filed under the rollout's hash again; another late
    #: row goes into the dicts again). Read with `units_of` and `ledger_units_of`, which add
    #: both.
    sealed_units: Packed = field(default_factory=lambda: Packed(low_bits=32))
    sealed_ledger: Packed = field(default_factory=Packed)
    #: When not None, each rollout's last event as (position, hash), kept up to date as units
    #: are indexed: a writer opening the store needs them once, and reading them here spares
    #: it a second read of every ledger file (`ParquetSource.event_heads`).
    heads: dict[str, tuple[int, str]] | None = None
    #: When not None (with `heads`), every rollout id met while indexing: headed ones first
    #: then those with calls only, each in order of first appearance (`ParquetSource.known`).
    headed: dict[str, None] | None = None
    called: dict[str, None] | None = None
    #: When not None (with `heads`), each attachment's sha256 -> the attachments file of its
    #: first copy, collected as units are indexed (`ParquetSource.known`: without it a writer's
    #: open read every attachments file a second time, a request each on object storage).
    attached: dict[str, str] | None = None
    #: As `Index.touched`.
    touched: dict[str, None] | None = None
    #: Held while a unit is indexed (`add_unit`) or the calls keyed (`key_calls`).
    adding: threading.Lock = field(default_factory=threading.Lock)

    def units_of(self, rollout_id: str) -> list[int]:
        """The packed calls row groups holding `rollout_id`'s calls (`rollout_units`)."""
        # Ascending, each once: while a unit is indexed on another thread (`add_unit`) a
        # rollout being sealed is in both forms for a moment.
        found = [*self.sealed_units.find(rollout_id), *self.rollout_units.get(rollout_id, ())]
        return sorted(set(found))

    def ledger_units_of(self, rollout_id: str) -> list[int]:
        """The packed units with ledger rows of `rollout_id` (`rollout_ledger`)."""
        found = [*self.sealed_ledger.find(rollout_id), *self.rollout_ledger.get(rollout_id, ())]
        return sorted(set(found))

    @property
    def ids_complete(self) -> bool:
        """Whether the dicts name every rollout (none was moved to the packed form)."""
        return not len(self.sealed_units) and not len(self.sealed_ledger)

    def _seal(self, sealed: set[str]) -> None:
        # Packed before they leave the dicts: a read on another thread never misses them.
        for rid in sealed:
            held = self.rollout_units.get(rid)
            if held is not None:
                self.sealed_units.add(rid, held)
                del self.rollout_units[rid]
            held = self.rollout_ledger.get(rid)
            if held is not None:
                self.sealed_ledger.add(rid, held)
                del self.rollout_ledger[rid]

    def key_calls(self, dfs: DatasetFS) -> Locator:
        """Start keeping a key per call (`calls`): those of the indexed units, from one read of
        each calls file's ids; `add_unit` files the later ones."""
        with self.adding:  # (no unit is indexed meanwhile: each is keyed once)
            if self.calls is not None:  # (keyed by another read meanwhile)
                return self.calls
            calls = Locator()
            for pos, files in enumerate(self.units):
                if CALLS in files:
                    for g, t in enumerate(read_groups(dfs, files[CALLS], ["call_id"])):
                        for cid in t.column("call_id").to_pylist():
                            calls.add(cid, pos, g)
            self.calls = calls
            return calls

    def add_unit(self, dfs: DatasetFS, unit: Marker) -> None:
        """Index `unit`. Reads of the index may run meanwhile, on other threads (the reader's
        lock held shared by both: `_refresh`): the unit's files are listed first, then where its
        blobs and attachments are, then its calls, then its ledger rows, so a read that meets
        one of its calls finds what the call refers to, and a read never meets a place in a
        unit not listed yet. Each rollout's ledger rows of the unit show at once (one entry).
        """
        with self.adding:
            self._add_unit(dfs, unit)

    def _add_unit(self, dfs: DatasetFS, unit: Marker) -> None:
        pos = len(self.units)
        files = unit.files
        self.units.append(unit.unit, files)
        if BLOBS in files:
            for g, t in enumerate(read_groups(dfs, files[BLOBS], ["key"])):
                for key in t.column("key").to_pylist():
                    self.blobs.add(key, pos, g)
        if ATTACHMENTS in files:
            for g, t in enumerate(read_groups(dfs, files[ATTACHMENTS], ["sha256"])):
                for sha in t.column("sha256").to_pylist():
                    self.attachments.add(sha, pos, g)
                    if self.attached is not None:
                        self.attached.setdefault(sha, files[ATTACHMENTS])
        if CALLS in files:
            for g, t in enumerate(read_groups(dfs, files[CALLS], ["call_id", "rollout_id"])):
                cols = t.to_pydict()
                if self.calls is not None:
                    for cid in cols["call_id"]:
                        self.calls.add(cid, pos, g)
                if self.called is not None:
                    self.called.update(dict.fromkeys(cols["rollout_id"]))
                if self.touched is not None:
                    self.touched.update(dict.fromkeys(cols["rollout_id"]))
                for rid in dict.fromkeys(cols["rollout_id"]):
                    held = self.rollout_units.get(rid)
                    if held is None:
                        held = self.rollout_units[sys.intern(rid)] = array("Q")
                    held.append(pos << 32 | g)
        sealed: set[str] = set()
        if LEDGER in files:
            columns = LEDGER_INDEX_COLUMNS if self.heads is None else _LEDGER_HEAD_COLUMNS
            cols = read_table(dfs, files[LEDGER], columns).to_pydict()
            if self.heads is not None:
                self._track_heads(cols)
            rows = zip(*(cols[c] for c in LEDGER_INDEX_COLUMNS), strict=True)
            for kind, rid, cid, reason, event_kind, state in rows:
                if kind == "orphan":
                    self.orphans[cid] = (rid, reason)
                    if self.touched is not None and rid is not None:
                        self.touched[rid] = None
                    continue
                if rid is None:
                    continue
                if self.touched is not None:
                    self.touched[rid] = None
                # The seal event, and the sealed header the proxy writes after it (then an
                # outcome's): each moves the rollout's places to the packed form again.
                if (kind == "event" and event_kind == "seal") or (
                    kind == "rollout" and state == "sealed"
                ):
                    sealed.add(rid)
                flag = int(kind == "rollout")
                if flag and self.headed is not None:
                    self.headed[rid] = None
                held = self.rollout_ledger.get(rid)
                if held is None:
                    held = self.rollout_ledger[sys.intern(rid)] = array("Q")
                if held and held[-1] >> 1 == pos:
                    held[-1] |= flag
                else:
                    held.append(pos << 1 | flag)
        self._seal(sealed)

    def _track_heads(self, cols: dict[str, list[Any]]) -> None:
        heads = self.heads
        assert heads is not None
        rows = zip(cols["kind"], cols["rollout_id"], cols["position"], cols["hash"], strict=True)
        for kind, rid, position, hash_ in rows:
            # The highest position, the later of two at one position (a fork): as
            # `ParquetSource.event_heads` reads them.
            if kind == "event" and position >= heads.get(rid, (-1, ""))[0]:
                heads[sys.intern(rid)] = (int(position), hash_)


class LRU(Generic[K, T]):
    """Least-recently-used values, evicted once their total weight exceeds `budget`.

    Safe to share between threads (a reader's reads run at once): each method holds a lock of
    its own for as long as it takes, never across a read of the store."""

    def __init__(self, budget: int, weigh: Callable[[T], int]) -> None:
        self.budget = budget
        self.weigh = weigh
        self.weight = 0
        self._items: OrderedDict[K, tuple[T, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def get(self, key: K) -> T | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: K, value: T) -> T:
        w = self.weigh(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.weight -= old[1]
            self._items[key] = (value, w)
            self.weight += w
            # Always keep the newest entry, even alone over budget: its caller is about to use
            # it.
            while self.weight > self.budget and len(self._items) > 1:
                _, (_, evicted) = self._items.popitem(last=False)
                self.weight -= evicted
        return value

    def pop(self, key: K) -> T | None:
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return None
            self.weight -= item[1]
            return item[0]

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.weight = 0
