"""The names and data files of a reader's units, packed: about 15 bytes a unit, no object each.

A reader that lives as long as a proxy holds every live unit's name (the listing it compares the
next one with, the units it indexed) and files (where a row group it is asked for is). As
Python strings and a `UnitFiles` per unit they took about 0.16 KB a unit; a proxy writing
Parquet commits a unit every ten calls or so, and the soak of docs/reports/reliability.md
(section 6) grew by them for as long as it ran. A unit name as written here (``<order>-<id>``:
20 decimal digits, a dash, 12 hex digits, `_layout.new_unit_name`) packs into 14 bytes, its
tables into one; the strings and `UnitFiles` are made again when asked for (a read asks for a
few). A name of another shape, or files not named after their unit, are kept as they are.
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import overload

from ._layout import TABLES, UnitFiles, unit_files

__all__ = ["UnitFileList", "UnitNames"]

_STANDARD = re.compile(r"[0-9]{20}-[0-9a-f]{12}\Z")
_ID_BYTES = 6
#: Each set of tables (a bit per table of `TABLES`) as the tuple a `UnitFiles` holds.
_TABLE_SETS = tuple(
    tuple(t for i, t in enumerate(TABLES) if mask >> i & 1) for mask in range(1 << len(TABLES))
)


class UnitNames(Sequence[str]):
    """Unit names in the order added: 8 bytes of order and 6 of id each (other names as they
    are). `is_prefix_of` tells whether a listing starts with these names without making them
    again (a proxy's reader asks at every refresh)."""

    __slots__ = ("_digest", "_ids", "_odd", "_orders")

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._orders = array("Q")
        self._ids = bytearray()
        #: position -> a name of another shape (its order, when it has one, is in `_orders`)
        self._odd: dict[int, str] = {}
        #: blake2b of the names so far, each followed by a newline (`is_prefix_of`)
        self._digest = hashlib.blake2b(digest_size=16)
        self.extend(names)

    def append(self, name: str) -> None:
        order = int(name[:20]) if _STANDARD.match(name) else -1
        if 0 <= order < 1 << 64:
            self._ids += bytes.fromhex(name[21:])
        else:
            self._odd[len(self._orders)] = name
            head = name.split("-", 1)[0]
            order = int(head) if head.isascii() and head.isdigit() and len(head) <= 19 else 0
            self._ids += bytes(_ID_BYTES)
        self._orders.append(order)
        self._digest.update(name.encode() + b"\n")

    def extend(self, names: Iterable[str]) -> None:
        for name in names:
            self.append(name)

    def __len__(self) -> int:
        return len(self._orders)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._name(j) for j in range(*i.indices(len(self)))]
        n = len(self._orders)
        if not -n <= i < n:
            raise IndexError("unit name index out of range")
        return self._name(i % n)

    def _name(self, i: int) -> str:
        odd = self._odd.get(i)
        if odd is not None:
            return odd
        at = i * _ID_BYTES
        return f"{self._orders[i]:020d}-{self._ids[at : at + _ID_BYTES].hex()}"

    def __iter__(self) -> Iterator[str]:
        return (self._name(i) for i in range(len(self._orders)))

    def nbytes(self) -> int:
        """Bytes held (the arrays and the names of other shapes)."""
        odd = sum(sys.getsizeof(name) for name in self._odd.values())
        return sys.getsizeof(self._orders) + sys.getsizeof(self._ids) + odd

    def max_order(self) -> int:
        """The highest order (commit time, ns) among the names; 0 when there are none."""
        return max(self._orders, default=0)

    def is_prefix_of(self, names: Sequence[str]) -> bool:
        """Whether `names` starts with these names, in this order: one hash of the joined
        text, not a string per name."""
        n = len(self)
        if len(names) < n:
            return False
        if not n:
            return True
        joined = "\n".join(names[:n]) + "\n"
        return hashlib.blake2b(joined.encode(), digest_size=16).digest() == self._digest.digest()


class UnitFileList(Sequence[Mapping[str, str]]):
    """Each unit's data files (table -> path), in the order added: its name (`UnitNames`) and a
    byte of which tables it has; ``list[i]`` is a `UnitFiles`. Files not named after their unit
    (``<table>/<unit>.parquet``) are kept as they are."""

    __slots__ = ("_odd", "_tables", "names")

    def __init__(self) -> None:
        self.names = UnitNames()
        self._tables = bytearray()
        self._odd: dict[int, Mapping[str, str]] = {}

    def append(self, unit: str, files: Mapping[str, str]) -> None:
        """Add `unit` and its `files` (`Marker.unit`, `Marker.files`)."""
        mask = sum(1 << i for i, t in enumerate(TABLES) if t in files)
        standard = (
            isinstance(files, UnitFiles)
            and files.unit == unit
            and files.tables == _TABLE_SETS[mask]
        ) or (len(files) == bin(mask).count("1") and files == unit_files(unit, files))
        if not standard:
            self._odd[len(self._tables)] = files
        # The name first: a read on another thread sees the unit once its tables byte is in.
        self.names.append(unit)
        self._tables.append(mask)

    def __len__(self) -> int:
        return len(self._tables)

    @overload
    def __getitem__(self, i: int) -> Mapping[str, str]: ...
    @overload
    def __getitem__(self, i: slice) -> list[Mapping[str, str]]: ...
    def __getitem__(self, i: int | slice) -> Mapping[str, str] | list[Mapping[str, str]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._tables)
        if not -n <= i < n:
            raise IndexError("unit index out of range")
        i %= n
        odd = self._odd.get(i)
        if odd is not None:
            return odd
        return UnitFiles(self.names[i], _TABLE_SETS[self._tables[i]])

    def __iter__(self) -> Iterator[Mapping[str, str]]:
        return (self[i] for i in range(len(self._tables)))

    def nbytes(self) -> int:
        """Bytes held, names included (files kept as they are count as their dict's size)."""
        odd = sum(sys.getsizeof(files) for files in self._odd.values())
        return self.names.nbytes() + sys.getsizeof(self._tables) + odd
