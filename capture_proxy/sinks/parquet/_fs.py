"""The files of a Parquet dataset, through a pyarrow filesystem (a local folder or object storage).

Every read, listing and delete goes through `pyarrow.fs`, so the same dataset code works on a local
folder, ``s3://bucket/prefix`` or any other filesystem pyarrow knows. Writes need one thing pyarrow
does not offer: `fsync`. On a local folder `DatasetFS.put_all` therefore writes with `os` calls
(temporary name, fsync, rename, fsync of the directory); on object storage a single upload is
already atomic and durable once it completes, so it writes through the filesystem's output stream.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["DatasetFS", "FileEntry", "Lock"]

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
    """A dataset root: `location` is a local folder path or a pyarrow filesystem URL.

    With `filesystem` (for example an `S3FileSystem` configured with credentials), `location`
    is a path inside it.
    """

    def __init__(self, location: str, filesystem: pafs.FileSystem | None = None) -> None:
        if filesystem is not None:
            fs, root = filesystem, location
        elif "://" in location:
            fs, root = pafs.FileSystem.from_uri(location)
        else:
            fs, root = pafs.LocalFileSystem(), os.path.abspath(location)
        self.fs: pafs.FileSystem = fs
        self.root: str = root.rstrip("/") or "/"
        self.local = isinstance(fs, pafs.LocalFileSystem)
        #: Files read ahead, by path (`ParquetSource` fetches small units on object storage
        #: concurrently); `open` serves them from memory while they are here.
        self.prefetched: dict[str, bytes] = {}

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    # -- reading --------------------------------------------------------------------------------

    def is_dir(self, rel: str = "") -> bool:
        return bool(self.fs.get_file_info(self.path(rel)).type == pafs.FileType.Directory)

    def exists(self, rel: str) -> bool:
        return bool(self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound)

    def read(self, rel: str) -> bytes:
        """The file's bytes; raises FileNotFoundError when it is missing."""
        with self.fs.open_input_stream(self.path(rel)) as f:
            return bytes(f.read())

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

    def names(self, rel: str) -> list[str]:
        """Names of the entries directly in `rel`, sorted; [] if it does not exist. Local: no
        stat per file (a commit folder holds one marker per unit)."""
        if not self.local:
            return [e.name for e in self.listdir(rel)]
        try:
            return sorted(os.listdir(self.path(rel)))
        except FileNotFoundError:
            return []

    # -- writing --------------------------------------------------------------------------------

    def makedirs(self, *rels: str) -> None:
        for rel in rels:
            self.fs.create_dir(self.path(rel), recursive=True)
        if self.local:
            # A new folder's own entry must be durable too, or a crash can lose the whole folder.
            for rel in {"", *(os.path.dirname(r) for r in rels)}:
                _fsync_dir(self.path(rel))

    def put_all(self, files: Mapping[str, bytes]) -> None:
        """Write each file under its name, durably; each appears whole or not at all.

        Local: every file goes to a temporary name and is fsynced, then all are renamed into
        place and their directories fsynced, so when this returns every file and every directory
        entry is on disk. Object storage: one upload per file (atomic and durable on completion).
        Several files do not appear together; commit markers (see `_layout`) give that.
        """
        if not self.local:
            for rel, data in files.items():
                with self.fs.open_output_stream(self.path(rel)) as out:
                    out.write(data)
            return
        staged: list[tuple[str, str]] = []
        try:
            for rel, data in files.items():
                final = self.path(rel)
                tmp = f"{final}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
                staged.append((tmp, final))
                _write_fsync(tmp, data)
            for tmp, final in staged:
                os.replace(tmp, final)
        except BaseException:
            for tmp, _ in staged:
                # Best effort: the original error is what the caller must see.
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise
        for d in sorted({os.path.dirname(final) for _, final in staged}):
            _fsync_dir(d)

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
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path(rel))


def _write_fsync(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
