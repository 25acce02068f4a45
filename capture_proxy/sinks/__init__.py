"""Storage backends behind the `StagingSink` / `StagingSource` protocols, and the registry of
store kinds that opens them by URL (`registry`; the built-in kinds are in `kinds`)."""

from .base import (
    CompactStats,
    GcStats,
    StagingSink,
    StagingSource,
    StoreError,
    StoreFormatError,
    UnsupportedStoreOperation,
)
from .memory import MemorySink
from .registry import StoreKind, open_sink, open_source, register_store_kind, store_kinds
from .urls import StoreURL

__all__ = [
    "CompactStats",
    "GcStats",
    "MemorySink",
    "StagingSink",
    "StagingSource",
    "StoreError",
    "StoreFormatError",
    "StoreKind",
    "StoreURL",
    "UnsupportedStoreOperation",
    "open_sink",
    "open_source",
    "register_store_kind",
    "store_kinds",
]
