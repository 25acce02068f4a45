"""What a Parquet reader keeps in memory: an index of the live units, and LRU caches.

The index holds, per staged call, where its row is (file, row group, row) and the few values
coordinates and lineage need; per blob and attachment, where its bytes are. It is built from a
handful of columns of each file, so opening a large dataset does not read its token data.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pyarrow as pa

from ._fs import DatasetFS
from ._layout import ATTACHMENTS, BLOBS, CALLS, LEDGER, Marker, read_groups, read_table
from ._ledger import LedgerState

__all__ = ["LRU", "CallRef", "Index", "Known", "Where", "ids_from_bytes"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
#: Units up to this size (all their files) are read whole when indexed.
SMALL_UNIT_BYTES = 1 << 20
#: Receives a row group read while indexing: (path, group) and the table.
Keep = Callable[[tuple[str, int], pa.Table], None]
_LITTLE = sys.byteorder == "little"

#: The columns of a calls file the index reads (the rest is loaded on demand).
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


@dataclass(slots=True)
class Known:
    """What a writer must know of a dataset to append to it (duplicates, dedup, lineage)."""

    calls: dict[str, str]  # call id -> rollout id
    #: rollout id -> seq -> the call holding it (staged, or in the ledger): one call per seq.
    seqs: dict[str, dict[int, str]]
    blobs: set[str]
    attachments: set[str]
    rollouts: set[str]
    last_order: int


@dataclass(slots=True)
class Index:
    """The live units of a snapshot, indexed. `add_unit` in commit order."""

    units: list[Marker] = field(default_factory=list)
    calls: dict[str, CallRef] = field(default_factory=dict)
    by_rollout: dict[str, list[str]] = field(default_factory=dict)
    blobs: dict[str, Where] = field(default_factory=dict)
    attachments: dict[str, Where] = field(default_factory=dict)
    ledger: LedgerState = field(default_factory=LedgerState)

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
            for g, t in groups(path, _INDEX_COLUMNS):
                for i, cid in enumerate(t["call_id"]):
                    if cid in self.calls:
                        continue  # a second copy (two writers): the first committed wins
                    # Interned: a rollout's calls share its id, a child its parent's id (the
                    # index holds every call, so a copy of each per call adds up).
                    parent = t["parent_call_id"][i]
                    ref = CallRef(
                        Where(path, g, i),
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
                    cid = sys.intern(cid)
                    self.calls[cid] = ref
                    self.by_rollout.setdefault(ref.rollout_id, []).append(cid)
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
            self.ledger.apply(read_table(dfs, files[LEDGER]).to_pylist())
        self.units.append(unit)


class LRU(Generic[K, T]):
    """Least-recently-used values, evicted once their total weight exceeds `budget`."""

    def __init__(self, budget: int, weigh: Callable[[T], int]) -> None:
        self.budget = budget
        self.weigh = weigh
        self.weight = 0
        self._items: OrderedDict[K, tuple[T, int]] = OrderedDict()

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def get(self, key: K) -> T | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: K, value: T) -> T:
        old = self._items.pop(key, None)
        if old is not None:
            self.weight -= old[1]
        w = self.weigh(value)
        self._items[key] = (value, w)
        self.weight += w
        # Always keep the newest entry, even alone over budget: its caller is about to use it.
        while self.weight > self.budget and len(self._items) > 1:
            _, (_, evicted) = self._items.popitem(last=False)
            self.weight -= evicted
        return value

    def clear(self) -> None:
        self._items.clear()
        self.weight = 0
