"""Store URLs, following SQLAlchemy's convention.

``sqlite:///relative.db`` and ``sqlite:////abs/path.db`` name a SQLite file; ``parquet:///rel/dir``
and ``parquet:////abs/dir`` a Parquet dataset folder; any URL pyarrow's filesystems understand
(``s3://bucket/prefix``, ``gs://...``, ``file:///...``) a Parquet dataset there. A plain path is
accepted too: ``*.db`` / ``*.sqlite`` / ``*.sqlite3`` is SQLite, anything else a Parquet folder.
``memory://`` is the in-process `MemorySink` (tests).

Which scheme, suffix or plain path is which kind is not written here: each store kind declares
its own (`capture_proxy.sinks.registry.StoreKind`), and `parse_store_url` asks the registry, so a
kind a plugin registers is opened by URL like the built-in ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import StoreError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .registry import StoreKind

__all__ = ["StoreURL", "parse_store_url"]


@dataclass(frozen=True, slots=True)
class StoreURL:
    #: The name of the store kind (``"sqlite"``, ``"parquet"``, ``"memory"``, or a plugin's).
    kind: str
    #: A filesystem path (sqlite, local parquet) or the whole URL (remote parquet, memory).
    location: str
    #: The canonical URL, as reported in commit coordinates.
    url: str


def parse_store_url(url: str, kinds: Sequence[StoreKind] | None = None) -> StoreURL:
    """Parse a store URL or path against `kinds` (default: every registered store kind);
    raises `StoreError` naming what is wrong."""
    if kinds is None:
        from .registry import store_kinds

        kinds = store_kinds()
    if not isinstance(url, str) or not url.strip():
        raise StoreError("store URL is empty: give sqlite:///file.db or parquet:///folder")
    url = url.strip()
    for kind in kinds:
        for scheme in kind.path_schemes:
            prefix = f"{scheme}:///"
            if url.startswith(prefix):
                path = url[len(prefix) :]
                if not path:
                    raise StoreError(f"store URL {url!r} names no path")
                return StoreURL(kind.name, path, url)
            if url.startswith(f"{scheme}:"):
                raise StoreError(
                    f"store URL {url!r}: write {scheme}:///relative/path or "
                    f"{scheme}:////absolute/path"
                )
    if "://" in url:
        scheme = url.split("://", 1)[0]
        for kind in kinds:
            if scheme in kind.url_schemes:
                return StoreURL(kind.name, url, url)
        known = "; ".join(f"{k.name} ({', '.join(_scheme_forms(k))})" for k in kinds)
        raise StoreError(
            f"store URL {url!r}: unknown scheme {scheme!r}; the known store kinds are {known}"
        )
    for kind in kinds:
        if kind.path_suffixes and url.endswith(kind.path_suffixes):
            return StoreURL(kind.name, url, f"{kind.path_schemes[0]}:///{url}")
    for kind in kinds:
        if kind.plain_paths:
            return StoreURL(kind.name, url, f"{kind.path_schemes[0]}:///{url}")
    raise StoreError(f"store URL {url!r} has no scheme: write kind:///path")


def _scheme_forms(kind: StoreKind) -> list[str]:
    return [f"{s}:///" for s in kind.path_schemes] + [f"{s}://" for s in kind.url_schemes]
