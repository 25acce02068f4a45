"""The SQLite store: one file, one writer thread with group commit, readers on the same file."""

from __future__ import annotations

from ._gc import (
    gc_sqlite,
)
from ._sink import (
    SQLiteSink,
    SQLiteSource,
)

__all__ = [
    "SQLiteSink",
    "SQLiteSource",
    "gc_sqlite",
]
