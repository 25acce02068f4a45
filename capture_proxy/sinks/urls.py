"""Store URLs, following SQLAlchemy's convention.

``sqlite:///relative.db`` and ``sqlite:////abs/path.db`` name a SQLite file; ``parquet:///rel/dir``
and ``parquet:////abs/dir`` a Parquet dataset folder; any URL pyarrow's filesystems understand
(``s3://bucket/prefix``, ``gs://...``, ``file:///...``) a Parquet dataset there. A plain path is
accepted too: ``*.db`` / ``*.sqlite`` / ``*.sqlite3`` is SQLite, anything else a Parquet folder.
``memory://`` is the in-process `MemorySink` (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import StoreError

__all__ = ["StoreURL", "parse_store_url"]

_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


@dataclass(frozen=True, slots=True)
class StoreURL:
    kind: Literal["sqlite", "parquet", "memory"]
    #: A filesystem path (sqlite, local parquet) or a pyarrow filesystem URL (remote parquet).
    location: str
    #: The canonical URL, as reported in commit coordinates.
    url: str


def parse_store_url(url: str) -> StoreURL:
    """Parse a store URL or path; raises `StoreError` naming what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise StoreError("store URL is empty: give sqlite:///file.db or parquet:///folder")
    url = url.strip()
    if url.startswith("memory://"):
        return StoreURL("memory", url, url)
    for scheme in ("sqlite", "parquet"):
        prefix = f"{scheme}:///"
        if url.startswith(prefix):
            path = url[len(prefix) :]
            if not path:
                raise StoreError(f"store URL {url!r} names no path")
            return StoreURL(scheme, path, url)
        if url.startswith(f"{scheme}:"):
            raise StoreError(
                f"store URL {url!r}: write {scheme}:///relative/path or {scheme}:////absolute/path"
            )
    if "://" in url:
        scheme = url.split("://", 1)[0]
        if scheme in ("file", "s3", "gs", "gcs", "hdfs", "abfs", "az"):
            return StoreURL("parquet", url, url)
        raise StoreError(f"store URL {url!r}: unknown scheme {scheme!r}")
    if url.endswith(_SQLITE_SUFFIXES):
        return StoreURL("sqlite", url, f"sqlite:///{url}")
    return StoreURL("parquet", url, f"parquet:///{url}")
