"""The blobs and attachments a Parquet writer refers to instead of storing them again.

A record's request and messages are content-keyed blobs and its images are attachments keyed
by sha256: a record refers to a copy already committed rather than storing the bytes again (an
agent re-sends its session's history and images with every call). It shares only copies
committed less than `dedup_window_s` ago (`_layout.DEDUP_WINDOW_S`, an hour): an older one is
stored again, and a reference alone to an older attachment is refused as
``missing_attachment``. That is what lets gc run while the proxy writes: it removes only copies
older than the window (`_gc`).

What the writer remembers is bounded (`_keys.RecentKeys`): the `max_blob_keys` blob keys and
the `max_attachment_keys` attachment sha256s used most recently. A blob not among them is
stored again (a few bytes more, never a wrong record; readers and compaction keep one copy);
likewise an attachment whose bytes are given, and a reference alone to one not among them is
looked up in the store. This lives apart from `_sink` so that the window rule and these bounds
have one home, used by the writer thread's work for each record.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from ...schemas.records import Attachment, StagedCallRecord, StageResult
from ..staging_rules import new_attachments
from ._keys import RecentKeys
from ._layout import ATTACHMENTS, BLOBS
from ._source import ParquetSource
from ._writer import UnitRows


class SharedCopies:
    """The blob keys and attachment sha256s a writer's records may refer to (the window rule),
    and how many references found an attachment already stored (`hits`).

    `known` maps the sha256 of each attachment in the store to its first copy's commit time
    (ns): the most recent fill the memory at open. `reader` is the writer's own, asked about an
    attachment referred to alone that is not remembered.
    """

    def __init__(
        self,
        reader: ParquetSource,
        known: Mapping[str, int],
        *,
        max_blob_keys: int,
        max_attachment_keys: int,
        window_s: float,
    ) -> None:
        self._reader = reader
        self._window_ns = int(window_s * 1e9)
        self.hits = 0
        self.blobs = RecentKeys(max_blob_keys, self._window_ns)
        self.attachments = RecentKeys(max_attachment_keys, self._window_ns)
        latest = sorted(known.items(), key=lambda kv: kv[1])[-self.attachments.limit :]
        for sha, order in latest:
            self.attachments.add(sha, at_ns=order)

    def attachments_to_store(
        self, batch: UnitRows, record: StagedCallRecord, given: Mapping[str, Attachment]
    ) -> list[Attachment] | StageResult:
        """The attachments `record` must store (those it may not refer to), or the result
        refusing it (a reference to one neither given nor shared, bytes that do not hash)."""
        checked = new_attachments(record, given, lambda sha: self._shared(batch, sha, given))
        if isinstance(checked, StageResult):
            return checked
        new, hits = checked
        self.hits += hits
        return new

    def add_blobs(self, batch: UnitRows, part: UnitRows, blobs: Mapping[str, bytes]) -> None:
        """Rows in `part` for the blobs of a record that are not shared."""
        for blob_key, data in blobs.items():
            if blob_key not in self.blobs and blob_key not in batch.blobs:
                part.rows[BLOBS].append({"key": blob_key, "data": data})
                part.blobs.add(blob_key)

    def add_attachments(self, part: UnitRows, new: list[Attachment]) -> None:
        """Rows in `part` for the attachments `attachments_to_store` said to store."""
        for att in new:
            part.rows[ATTACHMENTS].append(
                {
                    "sha256": att.sha256,
                    "media_type": att.media_type,
                    "size": att.size,
                    "data": att.data,
                }
            )
            part.attachments.add(att.sha256)

    def publish(self, batch: UnitRows) -> None:
        """Remember what a committed batch stored (only then may a record refer to it)."""
        for blob_key in batch.blobs:
            self.blobs.add(blob_key)
        for sha in batch.attachments:
            self.attachments.add(sha)

    def _shared(self, batch: UnitRows, sha: str, given: Mapping[str, Attachment]) -> bool:
        """Whether a record may refer to the stored copy of attachment `sha` (the window rule)."""
        if sha in batch.attachments or sha in self.attachments:
            return True
        if sha in given:
            return False  # not remembered: stored again (a few bytes more, never a wrong record)
        # A reference alone to a copy this writer no longer remembers: the store says.
        committed = self._reader.attachment_order(sha)
        if committed is None or time.time_ns() - committed >= self._window_ns:
            return False
        self.attachments.add(sha, at_ns=committed)
        return True
