"""Open a store by URL: a `StagingSink` to write it, a `StagingSource` to read it.

The sink modules are imported on demand, so a trainer that reads SQLite never imports pyarrow,
and nothing here imports aiohttp.
"""

from __future__ import annotations

from typing import Any

from .base import StagingSink, StagingSource, StoreError
from .memory import MemorySink
from .urls import parse_store_url

__all__ = ["open_sink", "open_source"]

_MEMORY: dict[str, MemorySink] = {}


def open_sink(url: str, **options: Any) -> StagingSink:
    """A writer for the store at `url` (see `capture_proxy.sinks.urls` for the URL forms)."""
    parsed = parse_store_url(url)
    if parsed.kind == "sqlite":
        from .sqlite import SQLiteSink

        return SQLiteSink(parsed.location, url=parsed.url, **options)
    if parsed.kind == "parquet":
        from .parquet import ParquetSink

        return ParquetSink(parsed.location, url=parsed.url, **options)
    # memory:// stores live for the process, so a reader opened later sees what was written.
    return _MEMORY.setdefault(parsed.url, MemorySink(parsed.url, **options))


def open_source(url: str, *, cache_bytes: int | None = None) -> StagingSource:
    """A reader for the store at `url`; raises `StoreError` when there is no store there.

    `cache_bytes` bounds a Parquet reader's row-group cache (a long-lived reader inside the
    proxy wants a small one; a trainer reading in bulk, the default).
    """
    parsed = parse_store_url(url)
    if parsed.kind == "sqlite":
        from .sqlite import SQLiteSource

        return SQLiteSource(parsed.location, url=parsed.url)
    if parsed.kind == "parquet":
        from .parquet import ParquetSource

        if cache_bytes is not None:
            return ParquetSource(parsed.location, url=parsed.url, cache_bytes=cache_bytes)
        return ParquetSource(parsed.location, url=parsed.url)
    if parsed.url not in _MEMORY:
        raise StoreError(f"no in-process store named {parsed.url}")
    return _MEMORY[parsed.url]
