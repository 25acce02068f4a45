"""The built-in store kinds: SQLite, Parquet, the in-process memory store, and the store of a
running proxy read over HTTP.

They register through `register_store_kind`, the function a plugin uses; the registry imports this
module the first time it is used. Each method imports its kind's package when called, so
resolving a URL imports neither sqlite3's store code nor pyarrow, and reading SQLite never
imports pyarrow. docs/storage.md ("Store kinds") has a row per kind; a test keeps it so.
"""

from __future__ import annotations

import os
from typing import Any

from .base import (
    CompactStats,
    GcStats,
    Progress,
    StagingSink,
    StagingSource,
    StoreError,
    UnsupportedStoreOperation,
)
from .memory import MemorySink
from .registry import StoreKind, register_store_kind
from .urls import StoreURL

__all__ = ["MemoryKind", "ParquetKind", "RemoteKind", "SQLiteKind"]


class SQLiteKind(StoreKind):
    """One SQLite file: ``sqlite:///x.db``, or a path ending in .db, .sqlite, .sqlite3."""

    name = "sqlite"
    label = "SQLite"
    path_schemes = ("sqlite",)
    path_suffixes = (".db", ".sqlite", ".sqlite3")

    def open_sink(self, store: StoreURL, **options: Any) -> StagingSink:
        from .sqlite import SQLiteSink

        # A transaction is cheap to read back whatever its size: nothing to gain from waiting.
        options.pop("linger_s", None)
        return SQLiteSink(store.location, url=store.url, **options)

    def open_source(self, store: StoreURL, *, cache_bytes: int | None = None) -> StagingSource:
        from .sqlite import SQLiteSource

        return SQLiteSource(store.location, url=store.url)

    def gc(
        self,
        store: StoreURL,
        *,
        older_than_ms: int,
        now_ms: int,
        dry_run: bool = False,
        vacuum: bool = False,
        progress: Progress | None = None,
        wait_s: float = 0.0,
    ) -> GcStats:
        from .sqlite import gc_sqlite

        return gc_sqlite(
            store.location,
            older_than_ms=older_than_ms,
            now_ms=now_ms,
            dry_run=dry_run,
            vacuum=vacuum,
            progress=progress,
        )

    def local_dir(self, store: StoreURL) -> str | None:
        return os.path.dirname(os.path.abspath(store.location))


class ParquetKind(StoreKind):
    """A Parquet dataset folder: ``parquet:///dir``, a pyarrow filesystem URL (``s3://``, ...),
    or any plain path SQLite does not claim."""

    name = "parquet"
    label = "Parquet"
    path_schemes = ("parquet",)
    url_schemes = ("file", "s3", "gs", "gcs", "hdfs", "abfs", "az")
    plain_paths = True

    def open_sink(self, store: StoreURL, **options: Any) -> StagingSink:
        from .parquet import ParquetSink

        if self.local_dir(store) is not None:
            # The linger saves a restart, a follower and a compaction requests per unit on
            # object storage; a local folder's units are read back from disk, and there it cost
            # calls its commit time under load (1.6x the added p50 at 100 calls a second,
            # docs/storage.md, "Fewer units: the writer's linger").
            options.pop("linger_s", None)
        return ParquetSink(store.location, url=store.url, **options)

    def open_source(self, store: StoreURL, *, cache_bytes: int | None = None) -> StagingSource:
        from .parquet import ParquetSource

        if cache_bytes is not None:
            # A bounded cache is what a reader living inside a proxy asks for (see
            # `registry.open_source`): indexed per unit, its memory does not grow with each call,
            # and its full sequences are a resumed rollout's few (the default 4M tokens: 16 MB).
            return ParquetSource(
                store.location,
                url=store.url,
                cache_bytes=cache_bytes,
                cache_tokens=max(1, cache_bytes // 16),
                index="units",
            )
        return ParquetSource(store.location, url=store.url)

    def gc(
        self,
        store: StoreURL,
        *,
        older_than_ms: int,
        now_ms: int,
        dry_run: bool = False,
        vacuum: bool = False,
        progress: Progress | None = None,
        wait_s: float = 0.0,
    ) -> GcStats:
        # `vacuum` has nothing to do here: a later compaction deletes the retired files.
        from .parquet import gc_parquet

        return gc_parquet(
            store.location,
            older_than_ms=older_than_ms,
            now_ms=now_ms,
            dry_run=dry_run,
            progress=progress,
            wait_s=wait_s,
        )

    def compact(
        self,
        store: StoreURL,
        *,
        target_bytes: int,
        grace_s: float,
        progress: Progress | None = None,
        wait_s: float = 0.0,
    ) -> CompactStats:
        from .parquet import compact_dataset

        return compact_dataset(
            store.location,
            target_bytes=target_bytes,
            grace_s=grace_s,
            progress=progress,
            wait_s=wait_s,
        )

    def local_dir(self, store: StoreURL) -> str | None:
        return None if "://" in store.location else os.path.abspath(store.location)


class MemoryKind(StoreKind):
    """``memory://name``: a `MemorySink` that lives as long as the process (tests), so a reader
    opened later by the same URL sees what was written. No gc, no compaction, no disk."""

    name = "memory"
    label = "in-process"
    url_schemes = ("memory",)

    def __init__(self) -> None:
        self.stores: dict[str, MemorySink] = {}

    def open_sink(self, store: StoreURL, **options: Any) -> StagingSink:
        options.pop("linger_s", None)  # no commits to group
        return self.stores.setdefault(store.url, MemorySink(store.url, **options))

    def open_source(self, store: StoreURL, *, cache_bytes: int | None = None) -> StagingSource:
        if store.url not in self.stores:
            raise StoreError(f"no in-process store named {store.url}")
        return self.stores[store.url]

    def describe(self, store: StoreURL) -> str:
        return f"{store.url} lives in a process's memory"


class RemoteKind(StoreKind):
    """``http://HOST:PORT`` (or ``https://``): the store of a running proxy, read through the
    read routes of its control API with a token (`capture_proxy.sinks.remote`). Read-only: the
    proxy writes its own store; gc and compaction run where the store is."""

    name = "remote"
    label = "remote"
    url_schemes = ("http", "https")
    takes_token = True

    def open_sink(self, store: StoreURL, **options: Any) -> StagingSink:
        raise UnsupportedStoreOperation(
            f"{self.describe(store)}: it is read-only; the proxy there writes its own store"
        )

    def open_source(
        self, store: StoreURL, *, cache_bytes: int | None = None, token: str | None = None
    ) -> StagingSource:
        from .remote import RemoteSource

        # Where no token is passed (the `inspect` and `export` commands), the environment's:
        # the variable the proxy reads its --reader-token from, so one setting serves both.
        token = token if token is not None else os.environ.get("CAPTURE_PROXY_READER_TOKEN")
        return RemoteSource(store.url, token=token)

    def describe(self, store: StoreURL) -> str:
        return f"{store.url} is a proxy's store read over HTTP"


register_store_kind(SQLiteKind())
register_store_kind(ParquetKind())
register_store_kind(MemoryKind())
register_store_kind(RemoteKind())
