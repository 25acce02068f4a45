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
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

from ..errors import CaptureProxyError

__all__ = ["CURSOR_VERSION", "CursorInvalid", "ExportCursor"]

#: The version of the cursor file's layout; a newer one is refused.
CURSOR_VERSION = 1


class CursorInvalid(CaptureProxyError, ValueError):
    """A cursor file that is not one this version of capture-proxy wrote."""


class ExportCursor:
    """The sealed rollouts incremental reads (`Store.iter_trajectories`, `export_store`) took.

    Pass the same cursor to each pass: a pass skips the rollouts in it and adds the sealed
    rollouts it hands over. `iter_trajectories` adds a rollout as it yields its trajectory;
    `export_store` adds the exported rollouts once the export is complete (a failed export adds
    none). Persist it between runs with `save` and `load`.
    """

    __slots__ = ("_ids",)

    def __init__(self, rollout_ids: Iterable[str] = ()) -> None:
        self._ids: dict[str, None] = dict.fromkeys(rollout_ids)

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

    def to_json(self) -> bytes:
        return json.dumps({"cursor_version": CURSOR_VERSION, "taken": list(self._ids)}).encode()

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
        if version != CURSOR_VERSION:
            raise CursorInvalid(
                f"{where} is an export cursor of version {version!r}; this capture-proxy reads "
                f"version {CURSOR_VERSION}: upgrade capture-proxy"
            )
        taken = doc.get("taken")
        if not isinstance(taken, list) or not all(isinstance(r, str) for r in taken):
            raise CursorInvalid(f"{where} is not an export cursor (taken is not a list of ids)")
        return cls(taken)

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
