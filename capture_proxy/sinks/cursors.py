"""Where a store keeps its consumers' cursors: `CursorStorage`.

A trainer taking batches (`capture_proxy.read.batches`) records what it was handed and what it
acknowledged in the store it reads, under its consumer name, so that a restarted trainer, or a
trainer on another host reading through the proxy, continues where it left off. The cursor's
content is `capture_proxy.read.cursor.ExportCursor`'s JSON; a store keeps it as bytes with a
revision, which a save must name (compare-and-set): two processes using one consumer name at once
cannot both record a batch.

The SQLite file keeps cursors in its ``consumers`` table (format 7); a Parquet dataset in
``consumers/<name>.json`` beside its tables (a whole object per save).
"""

from __future__ import annotations

import re
from typing import Protocol, runtime_checkable

from .base import StoreError

__all__ = ["CONSUMER_NAME", "CursorConflict", "CursorHolder", "CursorStorage", "check_consumer"]

#: Consumer names, as rollout ids: 1-128 characters of ``[A-Za-z0-9._:-]``.
CONSUMER_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class CursorConflict(StoreError):
    """Another process saved the consumer's cursor since it was loaded: nothing was written."""


def check_consumer(name: str) -> str:
    """`name` when it is a valid consumer name; ValueError saying the rule otherwise."""
    if not isinstance(name, str) or not CONSUMER_NAME.fullmatch(name):
        raise ValueError(
            f"consumer name {name!r} is not 1-128 characters of letters, digits and ._:-"
        )
    return name


@runtime_checkable
class CursorStorage(Protocol):
    """Consumers' cursors in a store. Blocking I/O."""

    def load(self, name: str) -> tuple[bytes, int] | None:
        """The cursor saved under `name` and its revision, or None when there is none."""
        ...

    def save(self, name: str, body: bytes, revision: int) -> int:
        """Store `body` under `name` if its revision is still `revision` (0: none saved yet);
        returns the new revision. Durable when it returns. Raises `CursorConflict` when another
        save came between, and `StoreError` when the store cannot be written."""
        ...


@runtime_checkable
class CursorHolder(Protocol):
    """A `StagingSource` whose store can keep consumers' cursors."""

    def consumer_cursors(self) -> CursorStorage:
        """The store's cursors (raises `StoreError` when this store cannot keep them)."""
        ...
