"""What every sink checks and returns the same way, whatever its storage: one place for it.

`new_attachments` decides which attachments a record's write must store (refusing a record whose
request refers to bytes that are neither given nor stored, or given bytes that do not hash to
their name), `coords_for` builds the coordinates a staged record is reported with, and
`take_batch` is the group-commit queue discipline both writer threads use.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..schemas.records import Attachment, CommitCoords, StagedCallRecord, StageResult

__all__ = ["coords_for", "new_attachments", "take_batch"]

T = TypeVar("T")


def new_attachments(
    record: StagedCallRecord,
    given: Mapping[str, Attachment],
    stored: Callable[[str], bool],
) -> tuple[list[Attachment], int] | StageResult:
    """The attachments to store with `record` and how many refs were already stored (dedup
    hits), or the ``capture_failed`` result refusing the record."""
    new: list[Attachment] = []
    hits = 0
    for sha in dict.fromkeys(record.attachment_refs()):
        if stored(sha):
            hits += 1  # stored by an earlier call: OpenCode re-sends its image every call
            continue
        att = given.get(sha)
        if att is None:
            return StageResult.failed(
                "missing_attachment",
                f"the request refers to attachment {sha}, which was neither given "
                "nor already stored",
            )
        if att.sha256 != sha or not att.check():
            return StageResult.failed(
                "bad_attachment", f"the bytes given for attachment {sha} do not hash to it"
            )
        new.append(att)
    return new, hits


def coords_for(url: str, record: StagedCallRecord, row: Mapping[str, Any]) -> CommitCoords:
    """The coordinates of a record staged as the codec `row`."""
    return CommitCoords(
        store=url,
        staging_key=record.staging_key,
        digest=record.digest,
        extras_digest=record.extras_digest,
        prev_len=row["prev_len"],
        delta_len=row["delta_len"],
        cum_len=row["cum_len"],
        weight_version=record.weight_version,
    )


def take_batch(jobs: queue.SimpleQueue[T | None], max_batch: int) -> tuple[list[T], bool]:
    """Block for one job, then take whatever else is queued, up to `max_batch`: the jobs that
    share one transaction. Returns them and whether the stop sentinel (None) was seen."""
    first = jobs.get()
    if first is None:
        return [], True
    batch = [first]
    while len(batch) < max_batch:
        try:
            more = jobs.get_nowait()
        except queue.Empty:
            break
        if more is None:
            return batch, True
        batch.append(more)
    return batch, False
