"""Where an incremental reader left off: the sealed rollouts it has taken.

    >>> cursor = ExportCursor.load("train.cursor")        # empty when the file does not exist
    >>> for traj in store.iter_trajectories(cursor=cursor):
    ...     train(traj)
    >>> cursor.save("train.cursor")

A training loop that reads a store again and again wants each sealed rollout exactly once. A
seal time cannot say which rollouts a previous pass saw: a rollout sealed (by its proxy's clock)
before that pass may become visible in the store after it (a group commit still pending, another
proxy's unit published later, clocks that disagree). The cursor records what the passes actually
took instead, by rollout id, so the next pass takes every sealed rollout it has not taken, however
late it appeared, and none twice. It holds only sealed rollouts: an open rollout read with
``include_open`` comes again once sealed, and rollouts left out (open, poisoned) come when they
qualify. Its file grows by one rollout id per rollout taken.

The same cursor is a trainer's place in the batch API (`capture_proxy.read.batches`), kept in
the store under the trainer's consumer name instead of a file: besides the rollouts taken
(delivered and acknowledged) it holds the batch delivered and not acknowledged yet (`pending`,
delivered again until it is), and the rollouts this consumer will never be handed (`passed`:
poisoned, stale, not verified, ...) with their reasons, so they are read once, not at every poll.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..errors import CaptureProxyError

__all__ = ["CURSOR_VERSION", "CursorInvalid", "ExportCursor"]

#: The version of the cursor file's layout; a newer one is refused. Version 2 added the batch
#: API's fields (`pending`, `passed`, `unreported`, `batches`); a version-1 file reads as a
#: cursor with none of them.
CURSOR_VERSION = 2


class CursorInvalid(CaptureProxyError, ValueError):
    """A cursor file that is not one this version of capture-proxy wrote."""


class ExportCursor:
    """The sealed rollouts incremental reads (`Store.iter_trajectories`, `export_store`) took.

    Pass the same cursor to each pass: a pass skips the rollouts in it and adds the sealed
    rollouts it hands over. `iter_trajectories` adds a rollout as it yields its trajectory;
    `export_store` adds the exported rollouts once the export is complete (a failed export adds
    none). Persist it between runs with `save` and `load`.
    """

    __slots__ = ("_ids", "batches", "closed_groups", "passed", "pending", "unreported")

    def __init__(self, rollout_ids: Iterable[str] = ()) -> None:
        self._ids: dict[str, None] = dict.fromkeys(rollout_ids)
        #: The batch API: the batch delivered and not acknowledged (its JSON form), if any.
        self.pending: dict[str, Any] | None = None
        #: The batch API: rollouts never to be delivered to this consumer -> why.
        self.passed: dict[str, str] = {}
        #: The batch API: rollouts passed since the last batch, to report in the next one.
        self.unreported: list[dict[str, Any]] = []
        #: The batch API: batches delivered so far (the next batch's number).
        self.batches = 0
        #: The batch API (groups): groups delivered or left out -> why; later members are
        #: passed (a group is delivered once, whole).
        self.closed_groups: dict[str, str] = {}

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[str]:
        """The rollout ids taken, in the order they were taken."""
        return iter(self._ids)

    def __repr__(self) -> str:
        return f"ExportCursor({len(self._ids)} rollouts)"

    def add(self, rollout_ids: Iterable[str]) -> None:
        """Record rollouts as taken."""
        self._ids.update(dict.fromkeys(rollout_ids))

    def seen(self, rollout_id: str) -> bool:
        """Taken, passed, or in the pending batch: not a candidate for a new batch."""
        if rollout_id in self._ids or rollout_id in self.passed:
            return True
        return self.pending is not None and rollout_id in self.pending["rollout_ids"]

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"cursor_version": CURSOR_VERSION, "taken": list(self._ids)}
        if self.pending is not None:
            doc["pending"] = self.pending
        if self.passed:
            doc["passed"] = self.passed
        if self.unreported:
            doc["unreported"] = self.unreported
        if self.batches:
            doc["batches"] = self.batches
        if self.closed_groups:
            doc["closed_groups"] = self.closed_groups
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, where: str = "cursor") -> ExportCursor:
        """The cursor `to_json` wrote; raises `CursorInvalid` (naming `where`) for anything else."""
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise CursorInvalid(f"{where} is not an export cursor (not JSON: {e})") from e
        if not isinstance(doc, dict) or "cursor_version" not in doc:
            raise CursorInvalid(f"{where} is not an export cursor (no cursor_version)")
        version = doc["cursor_version"]
        if version not in (1, CURSOR_VERSION):
            raise CursorInvalid(
                f"{where} is an export cursor of version {version!r}; this capture-proxy reads "
                f"versions 1 to {CURSOR_VERSION}: upgrade capture-proxy"
            )
        taken = doc.get("taken")
        if not isinstance(taken, list) or not all(isinstance(r, str) for r in taken):
            raise CursorInvalid(f"{where} is not an export cursor (taken is not a list of ids)")
        cursor = cls(taken)
        pending, passed = doc.get("pending"), doc.get("passed", {})
        unreported, batches = doc.get("unreported", []), doc.get("batches", 0)
        closed = doc.get("closed_groups", {})
        if not (
            (pending is None or (isinstance(pending, Mapping) and "rollout_ids" in pending))
            and isinstance(passed, dict)
            and isinstance(closed, dict)
            and isinstance(unreported, list)
            and isinstance(batches, int)
        ):
            raise CursorInvalid(f"{where} is not an export cursor (its batch fields are damaged)")
        cursor.pending = None if pending is None else dict(pending)
        cursor.passed = {str(k): str(v) for k, v in passed.items()}
        cursor.unreported = list(unreported)
        cursor.batches = batches
        cursor.closed_groups = {str(k): str(v) for k, v in closed.items()}
        return cursor

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ExportCursor:
        """The cursor saved at `path`, or an empty one when there is no file yet (a first pass).

        Raises `CursorInvalid` for a file that is not a cursor.
        """
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return cls()
        return cls.from_json(data, where=os.fspath(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the cursor to `path`, atomically: a crash leaves the previous cursor whole."""
        tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
