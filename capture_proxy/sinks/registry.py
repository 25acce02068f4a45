"""Store kinds, and everything done to a store by URL: open a writer or a reader, gc, compaction,
the local folder whose free space the proxy guards.

A *store kind* (`StoreKind`) is SQLite, Parquet, the in-process memory store, or one a plugin
adds. It declares the URLs that are its and implements what it can do; the functions here find
the kind of a URL and ask it. Nothing else in capture-proxy chooses by kind, so a new kind is one
class and one `register_store_kind` call. The built-in kinds (`capture_proxy.sinks.kinds`)
register through that same function, the first time the registry is used.

Kinds import their modules only when asked to open or maintain a store, so a trainer that reads
SQLite never imports pyarrow, and nothing here imports aiohttp.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ClassVar

from .base import (
    CompactStats,
    GcStats,
    Progress,
    StagingSink,
    StagingSource,
    StoreError,
    UnsupportedStoreOperation,
)
from .urls import StoreURL, parse_store_url

__all__ = [
    "StoreKind",
    "compact_store",
    "gc_store",
    "open_sink",
    "open_source",
    "register_store_kind",
    "resolve_store",
    "store_kinds",
    "store_local_dir",
    "unregister_store_kind",
]


class StoreKind:
    """One kind of store. Subclass it, set the class attributes, implement `open_sink` and
    `open_source` (and `gc`, `compact`, `local_dir` where the kind has them), then
    ``register_store_kind(MyKind())``.

    `gc` and `compact` are None on a kind that has no such operation; asking for one is then
    an `UnsupportedStoreOperation` naming the kind. Import heavy modules inside the methods, not
    at the top of the module that defines the kind.
    """

    #: Short name: `StoreURL.kind`, and the kind's row in docs/storage.md ("Store kinds").
    name: ClassVar[str] = ""
    #: How messages name the kind: "SQLite" -> "sqlite:///x.db is a SQLite store".
    label: ClassVar[str] = ""
    #: Schemes written ``scheme:///relative/path`` or ``scheme:////absolute/path``
    #: (SQLAlchemy's form); the location is the path. The first one spells canonical URLs.
    path_schemes: ClassVar[tuple[str, ...]] = ()
    #: Schemes whose whole URL is the location (``s3://bucket/prefix``, ``memory://name``).
    url_schemes: ClassVar[tuple[str, ...]] = ()
    #: A plain path (no scheme) ending so is this kind: ``x.db`` is SQLite.
    path_suffixes: ClassVar[tuple[str, ...]] = ()
    #: A plain path no kind's suffix claims is this kind (at most one kind: Parquet).
    plain_paths: ClassVar[bool] = False
    #: Opening a reader takes a ``token`` (a store behind an HTTP server that asks for one);
    #: `open_source` refuses a token for kinds without it.
    takes_token: ClassVar[bool] = False

    def open_sink(self, store: StoreURL, **options: Any) -> StagingSink:
        """A writer for `store`, created when there is none. `options` are the sink's own
        (``fault``, ``max_batch``, ...), and ``linger_s``: how long after a commit the writer
        may wait to group more writes into the next (a kind whose commits cost nothing to read
        back drops it)."""
        raise NotImplementedError

    def open_source(self, store: StoreURL, *, cache_bytes: int | None = None) -> StagingSource:
        """A reader for `store`; raise `StoreError` when there is no store there. `cache_bytes`
        bounds a reader's cache where it has one (None: the kind's default)."""
        raise NotImplementedError

    #: Retention, or None: a method ``gc(self, store, *, older_than_ms, now_ms, dry_run, vacuum,
    #: progress) -> GcStats`` removes the rollouts sealed before ``now_ms - older_than_ms`` (with
    #: ``dry_run``, only says what would go; ``vacuum``: give the space back now, where the kind
    #: can; ``progress``: a `Progress` callback or None).
    gc: Callable[..., GcStats] | None = None

    #: Compaction, or None: a method ``compact(self, store, *, target_bytes, grace_s, progress)
    #: -> CompactStats`` merges small files into files of up to ``target_bytes`` and deletes
    #: files retired more than ``grace_s`` seconds ago.
    compact: Callable[..., CompactStats] | None = None

    def local_dir(self, store: StoreURL) -> str | None:
        """The local folder the store's files live in, whose free space the proxy guards
        (``--min-free-disk-mb``); None for a store that is not on a local disk."""
        return None

    def describe(self, store: StoreURL) -> str:
        """`store` in a sentence, for errors: "sqlite:///x.db is a SQLite store"."""
        return f"{store.url} is {_a(self.label)} {self.label} store"

    def url_forms(self) -> list[str]:
        """How URLs of this kind begin, for messages: ``sqlite:///``, ``s3://``, ``*.db``."""
        forms = [f"{s}:///" for s in self.path_schemes]
        forms += [f"{s}://" for s in self.url_schemes]
        forms += [f"*{s}" for s in self.path_suffixes]
        if self.plain_paths:
            forms.append("any other path")
        return forms

    def __repr__(self) -> str:
        return f"<store kind {self.name}: {', '.join(self.url_forms())}>"


_LOCK = threading.RLock()
_KINDS: dict[str, StoreKind] = {}
_BUILTINS_LOADED = False


def _table() -> dict[str, StoreKind]:
    global _BUILTINS_LOADED
    with _LOCK:
        if not _BUILTINS_LOADED:
            _BUILTINS_LOADED = True
            from . import kinds  # registers sqlite, parquet, memory via register_store_kind

            del kinds
        return _KINDS


def register_store_kind(kind: StoreKind, *, replace: bool = False) -> StoreKind:
    """Make `kind` open the URLs it declares; returns it. Raises `ValueError` when its name,
    one of its schemes or suffixes, or plain paths already belong to another kind (``replace``
    lets a kind take over a registered kind of the same name)."""
    if not kind.name or not kind.label:
        raise ValueError(f"{type(kind).__name__} needs a name and a label")
    if not (kind.path_schemes or kind.url_schemes):
        raise ValueError(f"store kind {kind.name} declares no URL scheme")
    if (kind.path_suffixes or kind.plain_paths) and not kind.path_schemes:
        raise ValueError(f"store kind {kind.name} claims plain paths but has no path scheme")
    with _LOCK:
        table = _table()
        if kind.name in table and not replace:
            raise ValueError(f"a store kind named {kind.name} is already registered")
        taken: list[str] = []
        for other in table.values():
            if other.name == kind.name:
                continue
            mine = set(kind.path_schemes + kind.url_schemes) | set(kind.path_suffixes)
            theirs = set(other.path_schemes + other.url_schemes) | set(other.path_suffixes)
            clash = sorted(mine & theirs) + (
                ["plain paths"] if kind.plain_paths and other.plain_paths else []
            )
            taken += [f"{what} by {other.name}" for what in clash]
        if taken:
            raise ValueError(f"store kind {kind.name}: already taken: {', '.join(taken)}")
        table[kind.name] = kind
    return kind


def unregister_store_kind(name: str) -> None:
    """Forget the kind called `name` (a test's, or a built-in a plugin replaces entirely)."""
    with _LOCK:
        if _table().pop(name, None) is None:
            raise KeyError(f"no store kind named {name}")


def store_kinds() -> tuple[StoreKind, ...]:
    """Every registered kind, in registration order (built-ins first)."""
    with _LOCK:
        return tuple(_table().values())


def resolve_store(url: str) -> tuple[StoreKind, StoreURL]:
    """The kind of the store at `url`, and the URL parsed; raises `StoreError` for a URL no kind
    claims (naming the known kinds)."""
    kinds = store_kinds()
    store = parse_store_url(url, kinds)
    return next(k for k in kinds if k.name == store.kind), store


def open_sink(url: str, **options: Any) -> StagingSink:
    """A writer for the store at `url` (see `capture_proxy.sinks.urls` for the URL forms)."""
    kind, store = resolve_store(url)
    return kind.open_sink(store, **options)


def open_source(
    url: str, *, cache_bytes: int | None = None, token: str | None = None
) -> StagingSource:
    """A reader for the store at `url`; raises `StoreError` when there is no store there.

    `cache_bytes` bounds a Parquet reader's row-group cache (a long-lived reader inside the
    proxy wants a small one; a trainer reading in bulk, the default). Given, it also asks for a
    reader whose memory stays bounded (a Parquet reader indexed per unit, not per call). `token`
    is for kinds that ask for one (a proxy's store read over HTTP); giving one to another kind is
    a `StoreError`.
    """
    kind, store = resolve_store(url)
    if not kind.takes_token:
        if token is not None:
            raise StoreError(
                f"a token is for stores read through a proxy (http://, https://); "
                f"{kind.describe(store)}"
            )
        return kind.open_source(store, cache_bytes=cache_bytes)
    opener: Any = kind.open_source  # the kind's own signature, which takes `token`
    source: StagingSource = opener(store, cache_bytes=cache_bytes, token=token)
    return source


def gc_store(
    url: str,
    *,
    older_than_ms: int,
    now_ms: int,
    dry_run: bool = False,
    vacuum: bool = False,
    progress: Progress | None = None,
    wait_s: float = 0.0,
) -> GcStats:
    """Remove the store's rollouts sealed before ``now_ms - older_than_ms`` (`capture-proxy gc`);
    `progress` is told how far it is. `wait_s`: how long a Parquet gc waits for the dataset's
    maintenance lease, first in line, when another run holds it (0: refused at once).

    Raises `UnsupportedStoreOperation` for a kind without retention (the in-process store).
    """
    kind, store = resolve_store(url)
    if kind.gc is None:
        raise _unsupported("gc", "gc", store, kind)
    return kind.gc(
        store,
        older_than_ms=older_than_ms,
        now_ms=now_ms,
        dry_run=dry_run,
        vacuum=vacuum,
        progress=progress,
        **({"wait_s": wait_s} if wait_s else {}),
    )


def compact_store(
    url: str,
    *,
    target_bytes: int = 256 << 20,
    grace_s: float = 600.0,
    progress: Progress | None = None,
    wait_s: float = 0.0,
) -> CompactStats:
    """Merge the store's small files into files of up to `target_bytes` (`capture-proxy
    compact`); files retired more than `grace_s` seconds ago are deleted. `progress` is told
    how far it is; `wait_s` how long to wait for the maintenance lease, first in line, when
    another run holds it (0: refused at once).

    Raises `UnsupportedStoreOperation` for a kind without compaction (SQLite, memory).
    """
    kind, store = resolve_store(url)
    if kind.compact is None:
        raise _unsupported("compact", "compaction", store, kind)
    return kind.compact(
        store,
        target_bytes=target_bytes,
        grace_s=grace_s,
        progress=progress,
        **({"wait_s": wait_s} if wait_s else {}),
    )


def store_local_dir(url: str) -> str | None:
    """The local folder holding the store at `url`, whose free space the proxy guards; None for
    a store that is not on a local disk (memory, object stores)."""
    kind, store = resolve_store(url)
    return kind.local_dir(store)


def _unsupported(
    attr: str, operation: str, store: StoreURL, kind: StoreKind
) -> UnsupportedStoreOperation:
    able = [k.label for k in store_kinds() if getattr(k, attr) is not None]
    applies = f"{operation} applies to {_and(able)} stores" if able else f"no store has {operation}"
    return UnsupportedStoreOperation(f"{applies}; {kind.describe(store)}")


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _a(word: str) -> str:
    return "an" if word[:1].lower() in "aeio" else "a"
