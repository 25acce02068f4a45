"""The maintenance lease: one compaction or gc at a time per Parquet dataset, writers running.

Two maintenance runs at once would both merge (or rewrite) the same units, so each takes the
lease object ``_leases/maintenance`` first. Its body names the holder (host, pid, a random id),
what it runs and how long it holds after each write (`ttl_ms`). A run:

* **takes** it by creating the object only if it is absent; if it is present and expired (its
  holder died) or released, by replacing it only if it is unchanged since it was read (a
  compare-and-swap on its etag), so of two runs taking over at once exactly one wins;
* **renews** it from a background thread every third of `ttl_s`, again only if unchanged: a run
  whose lease was taken over (it stalled past its expiry) learns so at its next renewal, and
  `check` raises before it commits anything more;
* **releases** it at the end by writing a released body the same way, so the next run takes it
  at once.

A run takes it only to check and commit work it prepared before (`_merge`), and `Lease.held_s`
says for how long; `refuse_if_held` tells a run about to prepare that it would be refused.

A second run while the lease holds is refused with `StoreError` naming the holder and its expiry,
or waits for it with `wait_s`, first in line: it reserves the next turn in ``_leases/next`` (a
body like the lease's, renewed while it waits), and a run that finds the lease free while another
run's reservation is fresh is refused, so a waiting run is not starved by runs that come and go.

**Expiry is judged on the store's clock**, never by comparing two hosts' clocks: a taker
compares the lease object's Last-Modified with that of a clock object it writes at that moment
(``_leases/clock``; both stamped by the store), and takes the lease once it is older than
`ttl_ms`, plus a second on object storage (Last-Modified's resolution). The holder counts its
own hold on its monotonic clock from the moment it *sent* its last write, which the store
stamped later: it sees the lease end before any taker does. A lease body from a release
before `ttl_ms` is judged by its `expires_at_ms`, as that release did.

On object storage the conditional writes are the store's own: obstore's ``put(mode="create")``
(``If-None-Match: *``) and ``put(mode={"e_tag": ...})`` (``If-Match``); pyarrow's filesystems
cannot express either (docs/reports/object-store-spike.md). On a local folder the lease is a file
created exclusively and fsynced with its folder, and replaced by a renamed, fsynced file while a
`flock` on the folder is held (obstore's local store neither fsyncs nor has an etag mode); its
etag is the sha256 of its bytes, its age its mtime's (one host's clock).

**Fencing** is not the lease's: a holder that stalls past `ttl_s` between its last `check` and
its next commit could commit after another run took over, so every maintenance commit is also a
compare-and-swap of the dataset's checkpoint (`_checkpoint`), which such a run finds changed.
The same conditional writes serve the checkpoint (`conditional_object`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

import orjson
import pyarrow.fs as pafs

from ..base import StoreError
from ._fs import DatasetFS, fsync_dir, write_all_fsync

__all__ = [
    "LEASE",
    "Conditional",
    "Lease",
    "LeaseLost",
    "conditional_object",
    "maintenance_lease",
    "refuse_if_held",
]

#: The lease object, relative to the dataset root.
LEASE = "_leases/maintenance"
#: The reservation of the next turn by a run waiting for the lease (`Lease.acquire`).
NEXT = "_leases/next"
#: Written (empty) to read the store's clock: its Last-Modified is the store's "now".
_CLOCK = "_leases/clock"


class _Held(Exception):
    """The lease is held (or reserved) by another run: the refusal, as its message."""


class LeaseLost(StoreError):
    """The maintenance lease expired or was taken over while the run held it; it stopped
    before committing anything more."""


class Conditional(Protocol):
    """Conditional writes on one object: what the lease (and the checkpoint) need of a store."""

    def create(self, body: bytes) -> str | None:
        """Write `body` if the object is absent; its etag, or None when it exists."""

    def get(self) -> tuple[bytes, str] | None:
        """The object's body and etag, or None when it is absent."""

    def replace(self, body: bytes, etag: str) -> str | None:
        """Write `body` if the object's etag is still `etag`; the new etag, or None if not."""

    #: The resolution of `age_ms`: a lease is judged expired only this much after its `ttl_ms`
    #: (an object store's Last-Modified is in whole seconds, so an age read may be one second
    #: more than the real one).
    resolution_ms: int

    def age_ms(self) -> int | None:
        """How long ago the object was last written, on the store's own clock (None: absent)."""

    def remove(self) -> None:
        """Delete the object (unconditionally: its writer undoing its own write)."""


class _ObjectBackend:
    """The lease on object storage, through obstore's conditional puts."""

    resolution_ms = 1000

    def __init__(self, url: str, key: str = LEASE) -> None:
        self._key = key
        try:
            from obstore.store import from_url
        except ImportError as exc:  # pragma: no cover - obstore is a dependency
            raise StoreError("maintenance on object storage needs obstore") from exc
        try:
            self._store: Any = from_url(url.rstrip("/"))
        except Exception as exc:  # obstore refuses schemes it does not know
            raise StoreError(
                f"maintenance of {url} needs conditional writes, which capture-proxy makes "
                f"through obstore; obstore cannot open this URL: {exc}"
            ) from exc

    def create(self, body: bytes) -> str | None:
        import obstore
        from obstore.exceptions import AlreadyExistsError

        try:
            return str(obstore.put(self._store, self._key, body, mode="create")["e_tag"])
        except AlreadyExistsError:
            return None

    def get(self) -> tuple[bytes, str] | None:
        import obstore

        try:
            got = obstore.get(self._store, self._key)
        except FileNotFoundError:
            return None
        return bytes(got.bytes()), str(got.meta["e_tag"])

    def replace(self, body: bytes, etag: str) -> str | None:
        import obstore
        from obstore.exceptions import PreconditionError

        try:
            put = obstore.put(self._store, self._key, body, mode={"e_tag": etag})
        except (PreconditionError, FileNotFoundError):
            return None
        return str(put["e_tag"])

    def age_ms(self) -> int | None:
        # The store's clock, not this host's: the object's Last-Modified against that of a
        # clock object written now (hosts' clocks differ; the store stamps both).
        import obstore

        try:
            written = obstore.head(self._store, self._key)["last_modified"]
        except FileNotFoundError:
            return None
        obstore.put(self._store, _CLOCK, b"")
        now = obstore.head(self._store, _CLOCK)["last_modified"]
        return int((now - written).total_seconds() * 1000)

    def remove(self) -> None:
        import obstore

        obstore.delete(self._store, self._key)


class _LocalBackend:
    """The lease on a local folder: an exclusive, fsynced file; replaced under a folder flock."""

    resolution_ms = 0

    def __init__(self, root: str, key: str = LEASE) -> None:
        self._dir = os.path.join(root, os.path.dirname(key))
        self._path = os.path.join(root, key)

    def create(self, body: bytes) -> str | None:
        os.makedirs(self._dir, exist_ok=True)
        with self._folder_locked():
            try:
                fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return None
            write_all_fsync(fd, body)
            fsync_dir(self._dir)
        return _etag(body)

    def get(self) -> tuple[bytes, str] | None:
        try:
            with open(self._path, "rb") as f:
                body = f.read()
        except FileNotFoundError:
            return None
        return body, _etag(body)

    def age_ms(self) -> int | None:
        # One host's clock: the file's mtime and now are both this machine's.
        try:
            return (time.time_ns() - os.stat(self._path).st_mtime_ns) // 1_000_000
        except FileNotFoundError:
            return None

    def remove(self) -> None:
        with self._folder_locked(), contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
            fsync_dir(self._dir)

    def replace(self, body: bytes, etag: str) -> str | None:
        with self._folder_locked():
            current = self.get()
            if current is None or current[1] != etag:
                return None
            tmp = f"{self._path}.{uuid.uuid4().hex[:8]}.tmp"
            write_all_fsync(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), body)
            os.replace(tmp, self._path)
            fsync_dir(self._dir)
        return _etag(body)

    @contextlib.contextmanager
    def _folder_locked(self) -> Iterator[None]:
        # Held for a read and a rename: every process changing the lease file takes it, so a
        # compare and its swap are one step.
        fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _etag(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _now_ms() -> int:
    return int(time.time() * 1000)


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


class Lease:
    """A held maintenance lease (see the module docstring); `maintenance_lease` takes one."""

    def __init__(
        self,
        backend: Conditional,
        where: str,
        purpose: str,
        ttl_s: float,
        queue: Conditional | None = None,
    ) -> None:
        self._backend = backend
        #: The etag of the lease object this run replaced when it took the lease (None: it
        #: created it): `_checkpoint` learns from it whether another run took it meanwhile.
        self.taken_from: str | None = None
        #: The reservation of the next turn (`acquire` with `wait_s`), when there is one.
        self._queue = queue
        self._reserved = False
        self._where = where
        self.purpose = purpose
        self.ttl_s = ttl_s
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._etag: str | None = None
        #: When this run's hold ends, on this host's monotonic clock: `ttl_s` after the
        #: request of its last successful write was sent (the store stamps that write later,
        #: so a taker, judging by the store's clock, sees it expire after this).
        self._deadline = 0.0
        self._lost: str | None = None
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        #: When this run took the lease and released it (monotonic; `held_s`).
        self._taken_at: float | None = None
        self._released_at: float | None = None

    @property
    def held_s(self) -> float:
        """How long this run has held the lease (until its release), in seconds: from the
        moment its taking write was sent to the moment its released body was written (the
        writes' own time included)."""
        if self._taken_at is None:
            return 0.0
        return (self._released_at or time.monotonic()) - self._taken_at

    def _body(self, *, released: bool = False) -> bytes:
        ttl_ms = int(self.ttl_s * 1000)
        return orjson.dumps(
            {
                "holder": self.holder,
                "purpose": self.purpose,
                # Judged by takers on the store's clock: the object's age against `ttl_ms`.
                "ttl_ms": ttl_ms,
                "released": released,
                # For releases that compare this host's clock with theirs (before `ttl_ms`).
                "expires_at_ms": 0 if released else _now_ms() + ttl_ms,
                "written_at_ms": _now_ms(),
                "nonce": uuid.uuid4().hex,
            }
        )

    def _left_ms(self, info: dict[str, Any], backend: Conditional) -> int:
        """How long the lease (or reservation) described by `info`, the body of `backend`'s
        object, still holds (<= 0: expired or released)."""
        if info.get("released"):
            return 0
        ttl_ms = info.get("ttl_ms")
        if not isinstance(ttl_ms, int):  # written by a release without `ttl_ms`
            return int(info.get("expires_at_ms", 0)) - _now_ms()
        age = backend.age_ms()
        return 0 if age is None else ttl_ms + backend.resolution_ms - age

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lease, or raise `StoreError` naming the run that holds it. With `wait_s`,
        wait up to that long for it: the run reserves the next turn (`_leases/next`), so runs
        that come and go meanwhile cannot take it before this one (no starvation)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._take()
                break
            except _Held as held:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._unreserve()  # giving up: the turn is not held for nothing
                    raise StoreError(str(held)) from None
                self._reserve()
                time.sleep(min(1.0, left) * random.uniform(0.5, 1.0))
        self._unreserve()
        self._renewer = threading.Thread(
            target=self._renew_loop, name="capture-proxy-lease", daemon=True
        )
        self._renewer.start()

    def refuse_if_held(self) -> None:
        """Raise `StoreError` as `acquire` without `wait_s` would now (another run holds the
        lease, or has reserved the next turn), writing nothing to the lease: a run that prepares
        its work before taking the lease learns at once that it would be refused."""
        try:
            self._check_queue()
            current = self._backend.get()
            if current is not None:
                self._check_free(_decode(current[0]))
        except _Held as held:
            raise StoreError(str(held)) from None

    def _check_queue(self) -> None:
        if self._queue is not None:
            waiting = self._queue.get()
            if waiting is not None:
                info = _decode(waiting[0])
                if info.get("holder") != self.holder and self._left_ms(info, self._queue) > 0:
                    raise _Held(
                        f"another maintenance run is waiting for {self._where}: "
                        f"{info.get('purpose', '?')} by {info.get('holder', '?')} takes it "
                        f"next; run {self.purpose} again once it has finished"
                    )

    def _check_free(self, info: dict[str, Any]) -> None:
        left = self._left_ms(info, self._backend)
        if left > 0:
            raise _Held(
                f"another maintenance run holds {self._where}: "
                f"{info.get('purpose', '?')} by {info.get('holder', '?')}, until "
                f"{_when(_now_ms() + left)} unless renewed; run {self.purpose} "
                "again once it has finished (a holder that died is taken over once its "
                "lease expires)"
            )

    def _take(self) -> None:
        self._check_queue()
        sent = time.monotonic()
        etag = self._backend.create(self._body())
        if etag is None:
            current = self._backend.get()
            if current is None:  # released and removed meanwhile: try once more
                etag = self._backend.create(self._body())
            else:
                body, old = current
                self._check_free(_decode(body))
                sent = time.monotonic()
                etag = self._backend.replace(self._body(), old)
                self.taken_from = old
        if etag is None:
            raise _Held(
                f"another maintenance run took {self._where} at the same moment; "
                f"run {self.purpose} again once it has finished"
            )
        self._etag, self._deadline = etag, sent + self.ttl_s
        self._taken_at = sent

    def _reserve(self) -> None:
        """Hold the next turn, unless another waiting run holds it (then this one waits
        behind it). Renewed at each try, so it lapses `ttl_s` after a waiter died."""
        if self._queue is None:
            return
        got = self._queue.get()
        if got is None:
            self._reserved = self._queue.create(self._body()) is not None
            return
        info = _decode(got[0])
        if info.get("holder") == self.holder or self._left_ms(info, self._queue) <= 0:
            self._reserved = self._queue.replace(self._body(), got[1]) is not None

    def _unreserve(self) -> None:
        if self._queue is None or not self._reserved:
            return
        got = self._queue.get()
        if got is not None and _decode(got[0]).get("holder") == self.holder:
            with contextlib.suppress(OSError):
                self._queue.replace(self._body(released=True), got[1])
        self._reserved = False

    def renew(self) -> None:
        """Extend the lease by `ttl_s` if this run still holds it (else `check` will raise)."""
        with self._guard:
            if self._lost is not None or self._etag is None:
                return
            sent = time.monotonic()
            try:
                etag = self._backend.replace(self._body(), self._etag)
            # Any error of the store's client (a store that is down, a timeout): try again at
            # the next renewal; `check` stops the run if none succeeds in time.
            except Exception as e:
                if time.monotonic() >= self._deadline:
                    self._lost = f"it could not be renewed before it expired ({e})"
                return
            if etag is None:
                self._lost = "another run took it over (this run stalled past its expiry)"
                return
            self._etag, self._deadline = etag, sent + self.ttl_s

    def check(self) -> None:
        """Raise `LeaseLost` unless this run holds the lease with a third of `ttl_s` left;
        called before each commit."""
        with self._guard:
            if self._lost is None and self._deadline - time.monotonic() < self.ttl_s / 3:
                self._lost = "it is about to expire and was not renewed in time"
            if self._lost is not None:
                raise LeaseLost(
                    f"{self.purpose} of {self._where} stopped: its maintenance lease was lost "
                    f"({self._lost}); nothing more was committed, run it again"
                )

    def release(self) -> None:
        """Stop renewing and let the next run take the lease at once."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._guard:
            if self._lost is None and self._etag is not None:
                with contextlib.suppress(OSError):
                    self._backend.replace(self._body(released=True), self._etag)
            self._etag = None
            if self._taken_at is not None and self._released_at is None:
                self._released_at = time.monotonic()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self.renew()


def _decode(body: bytes) -> dict[str, Any]:
    try:
        info = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return info if isinstance(info, dict) else {}


def _local_root(dfs: DatasetFS) -> str | None:
    """The dataset's local folder, also when seen through a `SubTreeFileSystem` of one."""
    if dfs.local:
        return dfs.root
    fs = dfs.fs
    if isinstance(fs, pafs.SubTreeFileSystem) and isinstance(fs.base_fs, pafs.LocalFileSystem):
        return os.path.join(fs.base_path, dfs.root.lstrip("/"))
    return None


def conditional_object(dfs: DatasetFS, location: str, key: str) -> Conditional:
    """Conditional writes of the object `key` of the dataset at `location` (`dfs` its files)."""
    local = _local_root(dfs)
    return _LocalBackend(local, key) if local is not None else _ObjectBackend(location, key)


def refuse_if_held(location: str, purpose: str, dfs: DatasetFS | None = None) -> None:
    """Raise `StoreError` naming the holder when `maintenance_lease` would be refused now
    (without waiting); takes nothing."""
    dfs = dfs or DatasetFS(location)
    Lease(
        conditional_object(dfs, location, LEASE),
        dfs.path(LEASE),
        purpose,
        60.0,
        conditional_object(dfs, location, NEXT),
    ).refuse_if_held()


@contextlib.contextmanager
def maintenance_lease(
    location: str,
    purpose: str,
    *,
    ttl_s: float = 60.0,
    dfs: DatasetFS | None = None,
    wait_s: float = 0.0,
) -> Iterator[Lease]:
    """Hold the maintenance lease of the Parquet dataset at `location` (a folder or an object
    store URL, reached through obstore with the AWS_* / GOOGLE_* / AZURE_* environment) for the
    block: renewed every ``ttl_s / 3`` meanwhile, released after. `purpose` names the run in a
    refusal. Raises `StoreError` when another run holds it (after waiting up to `wait_s` for
    it, first in line: `Lease.acquire`); call `Lease.check` before each commit. `dfs` is the
    dataset's files when the caller has them open already.
    """
    dfs = dfs or DatasetFS(location)
    lease = Lease(
        conditional_object(dfs, location, LEASE),
        dfs.path(LEASE),
        purpose,
        ttl_s,
        conditional_object(dfs, location, NEXT),
    )
    lease.acquire(wait_s)
    try:
        yield lease
    finally:
        lease.release()
