"""Where exported rows go: a Parquet file in row groups sized for scans, JSON Lines (a file or
stdout), and the sibling Parquet file of the attachments the rows refer to."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any, Protocol

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from ...schemas.records import Attachment
from ._columns import ATTACHMENT_SCHEMA, json_rows, to_table

__all__ = ["AttachmentFile", "JsonLinesOut", "ParquetOut", "RowsOut", "atomic_file"]


class RowsOut(Protocol):
    def emit(self, columns: dict[str, list[Any]]) -> int:
        """Write the rows held in `columns`; return how many."""

    def finish(self, metadata: Mapping[str, str]) -> None:
        """Write what is buffered, and the file-level `metadata` where the format has some."""

    def abort(self) -> None:
        """Stop after a failure (the caller removes the file)."""


class ParquetOut:
    """Rows buffered into row groups of about `row_group_bytes` (Arrow's in-memory size).

    One row group per rollout would make a file of many tiny groups that every scan pays for;
    one group per file would hold the whole export in memory. Memory stays bounded by one
    row group plus the largest rollout.
    """

    def __init__(self, f: IO[bytes], schema: pa.Schema, row_group_bytes: int) -> None:
        self.schema = schema
        self.limit = row_group_bytes
        self.writer = pq.ParquetWriter(f, schema, compression="zstd")
        self.pending: list[pa.Table] = []
        self.pending_bytes = 0

    def emit(self, columns: dict[str, list[Any]]) -> int:
        table = to_table(columns, self.schema)
        self.pending.append(table)
        self.pending_bytes += table.nbytes
        if self.pending_bytes >= self.limit:
            self._flush()
        return int(table.num_rows)

    def _flush(self) -> None:
        if not self.pending:
            return
        table = pa.concat_tables(self.pending).combine_chunks()
        self.writer.write_table(table, row_group_size=max(1, table.num_rows))
        self.pending, self.pending_bytes = [], 0

    def finish(self, metadata: Mapping[str, str]) -> None:
        self._flush()
        self.writer.add_key_value_metadata(dict(metadata))
        self.writer.close()

    def abort(self) -> None:
        # The file is removed; closing the writer now keeps it from writing a footer into a
        # closed file when it is collected.
        with contextlib.suppress(Exception):
            self.writer.close()


class JsonLinesOut:
    """One JSON object per line; JSON values (request, response, ...) nested, not as text."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f

    def emit(self, columns: dict[str, list[Any]]) -> int:
        n = 0
        for row in json_rows(columns):
            self.f.write(orjson.dumps(row) + b"\n")
            n += 1
        return n

    def finish(self, metadata: Mapping[str, str]) -> None:
        self.f.flush()

    def abort(self) -> None:
        self.f.flush()


class AttachmentFile:
    """The attachments rows refer to, each written once (the first time a row refers to it).

    The file is made only when there is something to write, at a temporary path renamed by the
    caller once the export is complete.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: set[str] = set()
        self._file: IO[bytes] | None = None
        self._writer: pq.ParquetWriter | None = None

    def add(self, attachments: Iterable[Attachment]) -> None:
        new = {a.sha256: a for a in attachments if a.sha256 not in self.seen}
        if not new:
            return
        if self._writer is None:
            self._file = open(self.path, "wb")  # noqa: SIM115 (closed in close())
            self._writer = pq.ParquetWriter(self._file, ATTACHMENT_SCHEMA, compression="zstd")
        table = pa.table(
            {
                "sha256": list(new),
                "media_type": [a.media_type for a in new.values()],
                "size": [a.size for a in new.values()],
                "data": [a.data for a in new.values()],
            },
            schema=ATTACHMENT_SCHEMA,
        )
        self._writer.write_table(table)
        self.seen.update(new)

    def close(self, metadata: Mapping[str, str]) -> bool:
        """Finish the file; True when there is one."""
        if self._writer is None or self._file is None:
            return False
        self._writer.add_key_value_metadata(dict(metadata))
        self._writer.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return True

    def discard(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self._file is not None:
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[IO[bytes]]:
    """A file at a temporary path, renamed to `path` once the block ends without error."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
