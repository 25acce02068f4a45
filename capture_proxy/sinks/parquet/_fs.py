"""The files of a Parquet dataset: a local folder, or object storage.

Listings and Parquet reads go through `pyarrow.fs`, so the same dataset code reads a local
folder, ``s3://bucket/prefix`` or any other filesystem pyarrow knows, and `pyarrow.parquet` reads
footers and columns through its random-access files. Whole small files (commit markers, claims,
the format file) are read through obstore where there is a store: one ``GET`` each.

Writes differ by where the dataset is:

* **A local folder**: `os` calls, because pyarrow offers no `fsync`: temporary name, fsync,
  rename, fsync of the directory. A create-if-absent write (`DatasetFS.create`) is
  ``O_CREAT | O_EXCL`` and fsynced the same way. The files of one call (a unit's data files, a
  group commit's claims) are fsynced all at once, then their folders (`_sync`).
* **Object storage by URL** (``s3://``, ``gs://``, ``az://``...): through obstore, built from
  the URL and the standard environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``,
  ``AWS_REGION``, ...), or an obstore store given as `store`. Each file is one single-request
  ``PUT`` (pyarrow's output streams make every small file a 3-request multipart upload), durable
  once it returns; `create` is a ``PUT`` with ``If-None-Match: *``, which the store itself
  refuses when the key exists, whichever writer asks.
* **A configured pyarrow filesystem** (`filesystem` without `store`): writes through its output
  streams. Such a filesystem cannot create a file only if it is absent, so `create` there checks
  first and is not atomic (`enforced` is False): one writer per dataset.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import os
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import obstore
import pyarrow as pa
import pyarrow.fs as pafs
from obstore.exceptions import AlreadyExistsError

from ._sync import fsync_each, fsync_folders

if TYPE_CHECKING:
    from obstore.store import ObjectStore

__all__ = ["DatasetFS", "FileEntry", "Lock", "run_io"]

T = TypeVar("T")

#: Suffix of files being written; readers and dataset globs (``*.parquet``, ``*.json``) skip them.
TMP_SUFFIX = ".tmp"


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    size: int
    mtime_ns: int


class Lock:
    """An exclusive advisory lock on a file of a local dataset (no-op on object storage)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


class DatasetFS:
    """A dataset root: `location` is a local folder path or a filesystem URL.

    With `filesystem` (for example an `S3FileSystem` configured with credentials), `location`
    is a path inside it, read through it. `store` is an obstore store rooted at the same dataset
    (its prefix is the dataset's root) that writes go through; without it, a URL's store is built
    from the URL and the environment, and a `filesystem` without `store` is written through
    pyarrow (creates not enforced, see the module docstring).
    """

    def __init__(
        self,
        location: str,
        filesystem: pafs.FileSystem | None = None,
        store: ObjectStore | None = None,
    ) -> None:
        if filesystem is not None:
            fs, root = filesystem, location
        elif "://" in location:
            fs, root = pafs.FileSystem.from_uri(location)
        else:
            fs, root = pafs.LocalFileSystem(), os.path.abspath(location)
        self.fs: pafs.FileSystem = fs
        self.root: str = root.rstrip("/") or "/"
        self.local = isinstance(fs, pafs.LocalFileSystem) and store is None
        if store is None and not self.local and filesystem is None:
            store = obstore.store.from_url(location)
        #: Where object-storage writes go (None: a local folder, or pyarrow's filesystem).
        self.store: ObjectStore | None = store
        #: Whether `create` is refused by the store itself when the key exists.
        self.enforced = self.local or store is not None
        #: Files read ahead, by path (`ParquetSource` fetches small units on object storage
        #: concurrently); `open` serves them from memory while they are here.
        self.prefetched: dict[str, bytes] = {}
        #: Files of a large unit opened ahead with some columns' chunks fetched (`_ranged`), by
        #: path: (those columns, the file); a read of those columns takes it, once.
        self.ahead: dict[str, tuple[frozenset[str], pa.NativeFile]] = {}
        self._store_reads = True

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    # -- reading --------------------------------------------------------------------------------

    def is_dir(self, rel: str = "") -> bool:
        return bool(self.fs.get_file_info(self.path(rel)).type == pafs.FileType.Directory)

    def exists(self, rel: str) -> bool:
        return bool(self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound)

    def read(self, rel: str) -> bytes:
        """The file's bytes; raises FileNotFoundError when it is missing."""
        if self.store is not None and self._store_reads:
            # One GET (pyarrow's input stream asks for the size first: a HEAD per file).
            try:
                return bytes(obstore.get(self.store, rel).bytes())
            except FileNotFoundError:
                raise
            except Exception:
                # Configuration obstore does not take (credentials in a profile file, a plain-HTTP
                # endpoint without AWS_ALLOW_HTTP) while pyarrow does: a reader keeps working
                # through pyarrow; a writer's writes still fail, loudly, where obstore is needed.
                self._store_reads = False
        with self.fs.open_input_stream(self.path(rel)) as f:
            return bytes(f.read())

    def tag(self, rel: str) -> str | None:
        """What changes whenever the file is written again (None: it is absent): its etag on
        object storage (one ``HEAD``), its modification time and size in a folder."""
        if self.store is not None and self._store_reads:
            try:
                meta = obstore.head(self.store, rel)
            except FileNotFoundError:
                return None
            except Exception:
                self._store_reads = False
            else:
                return str(meta.get("e_tag") or meta["last_modified"])
        info = self.fs.get_file_info(self.path(rel))
        if info.type == pafs.FileType.NotFound:
            return None
        return f"{info.mtime_ns}:{info.size}"

    def object_store(self) -> ObjectStore | None:
        """The obstore store reads may go through (None: a local folder, a pyarrow filesystem
        without one, or a store obstore could not read: `read`)."""
        return None if self.local or not self._store_reads else self.store

    def open(self, rel: str) -> pa.NativeFile:
        """A random-access handle (what `pyarrow.parquet` reads footers and columns through)."""
        data = self.prefetched.get(rel)
        if data is not None:
            return pa.BufferReader(data)
        return self.fs.open_input_file(self.path(rel))

    def listdir(self, rel: str) -> list[FileEntry]:
        """Files directly in `rel` (not sub-folders), sorted by name; [] if it does not exist."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True))
        out = [
            FileEntry(i.base_name, int(i.size or 0), int(i.mtime_ns or 0))
            for i in infos
            if i.type == pafs.FileType.File
        ]
        return sorted(out, key=lambda e: e.name)

    def names(self, rel: str, after: str | None = None) -> list[str]:
        """Names of the entries directly in `rel`, sorted; [] if it does not exist. Local: no
        stat per file (a commit folder holds one marker per unit). With `after`, only the names
        that sort after it: on object storage the store skips the others itself (S3's
        ``StartAfter``), so a listing costs what follows `after`, not the whole folder."""
        if after is not None and self.store is not None and self._store_reads:
            found = self._names_after(rel, after)
            if found is not None:
                return found
        if not self.local:
            names = [e.name for e in self.listdir(rel)]
            return names if after is None else [n for n in names if n > after]
        try:
            if after is None:
                return sorted(os.listdir(self.path(rel)))
            # A folder is read whole, but only the names after `after` are kept: the others
            # are made and dropped one at a time (a listing of every name made a string of
            # each at once, some MB at every refresh of a proxy's reader on a large store).
            with os.scandir(self.path(rel)) as entries:
                return sorted(e.name for e in entries if e.name > after)
        except FileNotFoundError:
            return []

    def _names_after(self, rel: str, after: str) -> list[str] | None:
        """`names(rel, after)` through obstore; None when obstore cannot list here."""
        assert self.store is not None
        prefix = f"{rel}/"
        try:
            pages = obstore.list(self.store, prefix, offset=f"{prefix}{after}")
            paths = [m["path"] for page in pages for m in page]
        except Exception:
            # As `read`: configuration obstore does not take; pyarrow lists (every name).
            self._store_reads = False
            return None
        # Directly in `rel` only (a deeper key is no entry of it), as `listdir`.
        names = [p[len(prefix) :] for p in paths if p.startswith(prefix)]
        return sorted(n for n in names if n and "/" not in n and n > after)

    # -- writing --------------------------------------------------------------------------------

    def makedirs(self, *rels: str) -> None:
        if self.store is not None:
            return  # object stores have no folders: a key's prefix exists with its first object
        for rel in rels:
            self.fs.create_dir(self.path(rel), recursive=True)
        if self.local:
            # A new folder's own entry must be durable too, or a crash can lose the whole folder.
            for rel in {"", *(os.path.dirname(r) for r in rels)}:
                fsync_dir(self.path(rel))

    def put_all(self, files: Mapping[str, bytes]) -> None:
        """Write each file under its name, durably; each appears whole or not at all.

        Local: every file goes to a temporary name and is fsynced, then all are renamed into
        place and their directories fsynced, so when this returns every file and every directory
        entry is on disk. Object storage: one upload per file (atomic and durable on completion).
        Several files do not appear together; commit markers (see `_layout`) give that.
        """
        if self.store is not None:
            store = self.store
            if len(files) == 1:
                ((rel, data),) = files.items()
                obstore.put(store, rel, data, use_multipart=False)
                return

            async def put_each() -> None:
                await asyncio.gather(
                    *(obstore.put_async(store, r, d, use_multipart=False) for r, d in files.items())
                )

            run_io(put_each())
            return
        if not self.local:
            for rel, data in files.items():
                with self.fs.open_output_stream(self.path(rel)) as out:
                    out.write(data)
            return
        staged: list[tuple[str, str]] = []
        fds: list[int] = []
        try:
            try:
                for rel, data in files.items():
                    final = self.path(rel)
                    tmp = f"{final}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
                    staged.append((tmp, final))
                    fds.append(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                    _write_all(fds[-1], data)
                # Every file synced at once (`_sync`): the flushes share journal commits.
                failed = next((e for e in fsync_each(fds) if e is not None), None)
            finally:
                for fd in fds:
                    os.close(fd)
            if failed is not None:
                raise failed
            for tmp, final in staged:
                os.replace(tmp, final)
        except BaseException:
            for tmp, _ in staged:
                # Best effort: the original error is what the caller must see.
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise
        synced = fsync_folders(os.path.dirname(final) for _, final in staged)
        failed = next((e for e in synced.values() if e is not None), None)
        if failed is not None:
            raise failed

    def create(self, rel: str, data: bytes) -> bool:
        """Write `rel` durably only if it does not exist; False when it does (nothing written).

        Atomic when `enforced`: of several writers creating one key, in any processes, exactly
        one gets True. Blocking I/O.
        """
        if self.store is not None:
            try:
                obstore.put(self.store, rel, data, mode="create", use_multipart=False)
            except AlreadyExistsError:
                return False
            return True
        if not self.local:
            if self.exists(rel):
                return False
            self.makedirs(os.path.dirname(rel))  # some filesystems need the folder
            self.put_all({rel: data})
            return True
        got = self.create_all({rel: data})[rel]
        if isinstance(got, Exception):
            raise got
        return got

    def create_all(self, files: Mapping[str, bytes]) -> dict[str, bool | Exception]:
        """`create` for several files: per file, True (created, durable), False (it existed:
        nothing written) or the error that kept it from being created (then it is not there).

        On a local folder the files are created one by one (each exclusively), then synced all
        at once with their folders (`_sync`): the batch waits for about one flush, not two per
        file. Elsewhere, one `create` after another. Blocking I/O.
        """
        out: dict[str, bool | Exception] = {}
        if not self.local:
            for rel, data in files.items():
                try:
                    out[rel] = self.create(rel, data)
                except Exception as e:
                    out[rel] = e
            return out
        opened: list[tuple[str, int]] = []  # created here: (rel, fd)
        try:
            try:
                for rel, data in files.items():
                    path = self.path(rel)
                    try:
                        if not os.path.isdir(os.path.dirname(path)):
                            self.makedirs(os.path.dirname(rel))
                    except OSError as e:  # a file where the folder should be: an error too
                        out[rel] = e
                        continue
                    try:
                        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    except FileExistsError:
                        out[rel] = False
                        continue
                    except OSError as e:
                        out[rel] = e
                        continue
                    opened.append((rel, fd))
                    try:
                        _write_all(fd, data)
                    except OSError as e:
                        out[rel] = e
                written = [rel for rel, _ in opened if rel not in out]
                synced = fsync_each([fd for rel, fd in opened if rel not in out])
            finally:
                for _, fd in opened:
                    os.close(fd)
            folders = {rel: os.path.dirname(self.path(rel)) for rel in written}
            folders_synced = fsync_folders(folders.values())
            for rel, error in zip(written, synced, strict=True):
                if error is None:
                    error = folders_synced[folders[rel]]
                out[rel] = True if error is None else error
        except BaseException:
            for rel, _ in opened:
                if out.get(rel) is not True:
                    out[rel] = OSError(f"{rel}: interrupted before it was durable")
            raise
        finally:
            # Not created, then: a file that is not durable (a full disk, a failed flush) must
            # not hold the key.
            for rel, _ in opened:
                if isinstance(out.get(rel), Exception):
                    with contextlib.suppress(OSError):
                        os.unlink(self.path(rel))
        return out

    async def create_async(self, rel: str, data: bytes) -> bool:
        """`create` on an event loop: object stores only (many claims in flight at once)."""
        assert self.store is not None
        try:
            await obstore.put_async(self.store, rel, data, mode="create", use_multipart=False)
        except AlreadyExistsError:
            return False
        return True

    def lock(self, rel: str) -> Lock:
        """Take the lock file `rel` exclusively, or raise BlockingIOError if another holder has it.

        Local folders only: object stores have no lock, so there the caller must ensure it is
        alone (the returned lock does nothing).
        """
        if not self.local:
            return Lock(None)
        fd = os.open(self.path(rel), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        return Lock(fd)

    def delete(self, rel: str) -> None:
        """Remove a file; one already gone is fine (deletes are retried after crashes)."""
        if self.store is not None:
            obstore.delete(self.store, rel)  # a missing key is not an error on object stores
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path(rel))

    def delete_many(self, rels: Sequence[str]) -> None:
        """Remove the files `rels`; ones already gone are fine. On S3 one ``DeleteObjects``
        request per thousand keys (obstore's bulk delete; other stores: concurrent deletes),
        where a loop of `delete` costs a round trip per file (measured on moto: 400 files
        0.9 s one by one, 0.02 s in bulk)."""
        if not rels:
            return
        if self.store is not None:
            obstore.delete(self.store, list(rels))
            return
        for rel in rels:
            self.delete(rel)


def run_io(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` (object-store requests issued concurrently) to completion from blocking code.

    The writer thread has no event loop; code that calls in from a thread running one (a test,
    a CLI command inside `asyncio.run`) gets a short-lived thread of its own.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work).result()


def write_all_fsync(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd`, fsync it and close it (closed on failure too)."""
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: str) -> None:
    """fsync a folder, so the names created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
