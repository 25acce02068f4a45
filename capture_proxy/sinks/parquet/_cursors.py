"""Consumers' cursors in a Parquet dataset: ``consumers/<name>.json``, beside the tables.

Each save writes the whole cursor as one file (a temporary file renamed into place locally, one
object on object storage): a crash leaves the previous cursor whole. The revision is checked by
reading the file before writing it, which is enough for one process per consumer name, the
documented use; two processes saving one name at the same instant are not refused here (on
SQLite they are). Compaction and gc leave the folder alone: it is not one of the tables.
"""

from __future__ import annotations

import orjson

from ..base import StoreError
from ..cursors import CursorConflict
from ._fs import DatasetFS

__all__ = ["CONSUMERS_DIR", "ParquetCursors"]

CONSUMERS_DIR = "consumers"


class ParquetCursors:
    """`CursorStorage` over a dataset's ``consumers/`` folder."""

    def __init__(self, dfs: DatasetFS) -> None:
        self.dfs = dfs

    def _read(self, name: str) -> tuple[bytes, int] | None:
        try:
            data = self.dfs.read(f"{CONSUMERS_DIR}/{name}.json")
        except FileNotFoundError:
            return None
        try:
            doc = orjson.loads(data)
            return str(doc["body"]).encode(), int(doc["revision"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise StoreError(f"consumer {name!r}'s cursor file is damaged: {e}") from e

    def load(self, name: str) -> tuple[bytes, int] | None:
        return self._read(name)

    def save(self, name: str, body: bytes, revision: int) -> int:
        found = self._read(name)
        stored = 0 if found is None else found[1]
        if stored != revision:
            raise CursorConflict(
                f"consumer {name!r}: its cursor is at revision {stored}, not {revision}: "
                "another process takes batches under this name"
            )
        doc = orjson.dumps({"revision": revision + 1, "body": body.decode()})
        try:
            self.dfs.makedirs(CONSUMERS_DIR)
            self.dfs.put_all({f"{CONSUMERS_DIR}/{name}.json": doc})
        except OSError as e:
            raise StoreError(f"cannot save consumer {name!r}'s cursor: {e}") from e
        return revision + 1
