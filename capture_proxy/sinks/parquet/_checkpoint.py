"""The checkpoint: a Parquet dataset's live units in one object, kept by maintenance runs.

    _checkpoint/live.json

Without it, opening a dataset reads one commit marker per unit listed in ``_commits/``, retired
ones included (a compaction's retired markers stay for its grace period): on object storage a
request each, so an open cost grew with every unit ever committed and not yet deleted. Table
formats keep a checkpoint of their log for the same reason. Its body (JSON)::

    {"format": 1, "generation": 7, "written_at_ms": 1764950400000, "writer": "host:pid:id",
     "units": [<the commit marker of each live unit, as in _commits/, in commit order>],
     "retired": {<name of a retired unit whose marker may still be listed>: <when it was
                 retired, ms: the earliest created_at_ms of a marker retiring it>, ...},
     "listed_after": "01764950280000000000"}

``listed_after`` (the *horizon*, added to format 1: a reader that does not know it lists every
name, which stays correct) is a 20-digit unit order: every marker whose name sorts before it is
named in the checkpoint (live or retired), or was deleted. The run that writes the checkpoint
takes it from its own listing of ``_commits/``: the latest of its clock when the listing started
and the highest order listed, less `COMMIT_MARGIN_S`. A marker not listed then lands later,
within `COMMIT_LIMIT_S` of the time in its name (writers retract a unit that took longer), so
its name sorts after the horizon as long as hosts' clocks differ by less than
``(COMMIT_MARGIN_S - COMMIT_LIMIT_S) / 2`` (45 s). A merged unit a maintenance run writes takes
an older order (its last unit's), but its marker is written after the checkpoint naming it.

**Reading** (`load_markers`): read the checkpoint (one GET), then list ``_commits/`` (names
only; after the horizon when the checkpoint has one: on object storage the store skips the rest,
so the retired markers a compaction's grace period keeps are not even listed once they are
older than the horizon), and read only the markers the checkpoint does not name, live or
retired: the units committed since. The dataset's live units are then the checkpoint's and the
new ones, less every unit the checkpoint or a new marker retires. A checkpoint is used only
when every live unit it names (after its horizon, the ones a listing shows) is still listed;
otherwise (a newer maintenance run of a release without checkpoints retired and deleted some)
it is ignored and every marker is listed and read, as without one. A dataset without a
checkpoint (written before it existed) reads as before. Maintenance runs list every name (their
clean-up needs the retired ones).

**Writing** (`Checkpoint.commit`): only maintenance runs write it, holding the lease, each with
a compare-and-swap on the checkpoint they read when they started (``If-Match`` on its etag, or
``If-None-Match: *`` when there was none). That is the run's **fence**: a merge writes its data
files (before the run takes the lease, `_merge`), then the new checkpoint (which names the
merged units live and the units they replace retired: one write for all the run's merges), then
the merged units' markers. A run that stalled past its lease while another took
over finds the checkpoint changed, commits nothing and deletes its data files (`LeaseLost`). A
crash between the checkpoint and the marker leaves a checkpoint naming a unit that is not
listed: readers ignore that checkpoint (and read the old units, the same rows), and the next
maintenance run writes the missing marker from the checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ._fs import DatasetFS
from ._layout import Marker, horizon_before, list_markers
from ._lease import LEASE, Conditional, Lease, LeaseLost, conditional_object, maintenance_lease
from ._snapshot import read_markers

__all__ = [
    "CHECKPOINT",
    "Checkpoint",
    "Loaded",
    "holding",
    "horizon",
    "load_markers",
    "read_checkpoint",
]

#: The checkpoint object, relative to the dataset root.
CHECKPOINT = "_checkpoint/live.json"
_FORMAT = 1


@dataclass(slots=True)
class Loaded:
    """What an open needs of the markers: the ones read, the names listed, what is retired."""

    #: The markers read: the live units' (from the checkpoint) and those committed since.
    markers: dict[str, Marker]
    #: Every unit listed in ``_commits/`` (retired ones too: their markers were not read).
    names: list[str]
    #: Units retired (by the checkpoint or by a marker read).
    retired: set[str]
    #: The checkpoint as read (None: there was none, or it was not used).
    checkpoint: dict[str, Any] | None = None
    #: Live units the checkpoint names whose markers are missing (a crash mid-commit).
    unlisted: list[Marker] = field(default_factory=list)
    #: When each unit the checkpoint names retired was retired (ms), as it recorded.
    since: dict[str, int] = field(default_factory=dict)
    #: The checkpoint's horizon when the listing started after it: `names` holds only the
    #: names that sort after it (None: every name was listed).
    after: str | None = None
    #: When the listing started (`time.time_ns`): what a checkpoint written from it records.
    listed_at_ns: int = 0

    def last_order(self) -> int:
        """The highest unit order this reading knows of (listed, or named by the checkpoint,
        or its horizon): a writer names its units after it."""
        names = [*self.names[-1:], *self.markers, *self.since]
        last = max(names, default="0")  # 20-digit orders first: name order is order
        return max(_order(last), int(self.after or 0))

    def live(self) -> list[Marker]:
        """The live units, in commit order."""
        return [self.markers[u] for u in sorted(self.markers) if u not in self.retired]

    def retired_at(self, markers: Iterable[Marker] = ()) -> dict[str, int]:
        """When each retired unit was retired (ms): the earliest `created_at_ms` of a marker
        retiring it (those read, and `markers`), or the time the checkpoint recorded, whichever
        is earlier (a unit retired again by a later merge that inherits it keeps its first
        time); a unit known retired by neither gets the checkpoint's own time."""
        out = dict(self.since)
        for m in [*self.markers.values(), *markers]:
            for name in m.retires:
                out[name] = min(out.get(name, m.created_at_ms), m.created_at_ms)
        written = int((self.checkpoint or {}).get("written_at_ms", time.time() * 1000))
        for name in self.retired - out.keys():
            out[name] = written
        return out


def read_checkpoint(dfs: DatasetFS) -> dict[str, Any] | None:
    """The checkpoint's body, or None when there is none (or it is not one this release
    reads: then it is not used)."""
    try:
        return _parse(dfs.read(CHECKPOINT))
    except FileNotFoundError:
        return None


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or body.get("format") != _FORMAT:
        return None
    return body


def load_markers(
    dfs: DatasetFS,
    names: list[str] | None = None,
    object_url: str | None = None,
    *,
    checkpoint: dict[str, Any] | bool | None = True,
    repair: bool = False,
) -> Loaded:
    """The dataset's markers as an open needs them (see the module docstring): `names` is the
    listing of ``_commits/`` when the caller has it; `checkpoint` the checkpoint's body when
    the caller read it (True: read it here; False or None: none). Markers are read
    concurrently on object storage (with `object_url`, through obstore). With `repair` (a
    maintenance run) a checkpoint naming live units that are not listed is used, and those
    units are in `Loaded.unlisted`; otherwise such a checkpoint is ignored."""
    body = read_checkpoint(dfs) if checkpoint is True else checkpoint or None
    if body is not None:
        try:
            units = {m.unit: m for m in map(_marker, body["units"])}
            since = {str(u): int(ms) for u, ms in body["retired"].items()}
            retired = set(since)
        except (KeyError, TypeError, ValueError, AttributeError):
            body = None
    # Listed after the checkpoint was read: a unit a maintenance run merged meanwhile is then
    # either listed or named by the checkpoint as it was (its units: the same rows).
    after = horizon(body) if names is None and not repair else None
    listed_at = time.time_ns()
    names = list_markers(dfs, after) if names is None else names
    if body is None:
        return _every(dfs, names, object_url, listed_at)
    listed = set(names)
    # Before the horizon a name is not listed: the checkpoint stands for it.
    unlisted = [m for u, m in units.items() if u not in listed and (after is None or u > after)]
    if unlisted and not repair:
        # A run crashed between its checkpoint and its marker: read as if there were none
        # (the units it merged, the same rows) until a maintenance run writes the marker.
        if after is not None:
            listed_at = time.time_ns()
            names = list_markers(dfs)
        return _every(dfs, names, object_url, listed_at)
    known = units.keys() | retired
    fresh = read_markers(dfs, [n for n in names if n not in known], object_url)
    markers = {**units, **fresh}
    retired |= _retired_by(markers.values())
    return Loaded(markers, names, retired, body, unlisted, since, after, listed_at)


def _every(dfs: DatasetFS, names: list[str], object_url: str | None, listed_at: int) -> Loaded:
    """Every listed marker read (no checkpoint used)."""
    markers = read_markers(dfs, names, object_url)
    return Loaded(markers, names, _retired_by(markers.values()), listed_at_ns=listed_at)


def _order(unit: str) -> int:
    return int(unit.split("-", 1)[0])


def horizon(body: Mapping[str, Any] | None) -> str | None:
    """The checkpoint's ``listed_after`` (see the module docstring), or None."""
    after = (body or {}).get("listed_after")
    if isinstance(after, str) and len(after) == 20 and after.isdigit():
        return after
    return None


def _marker(d: Mapping[str, object]) -> Marker:
    return Marker.decode(orjson.dumps(d))


def _retired_by(markers: Iterable[Marker]) -> set[str]:
    return {u for m in markers for u in m.retires}


class Checkpoint:
    """A maintenance run's view of the checkpoint: what it read, and its fenced commits.

    Made before the run takes the lease, so the listing (a `LIST` per thousand markers, most of
    an open on a store with many units) and the merges made from it (`_merge.prepare`) are not
    done while it holds it; `hold` then uses that reading only if nobody took the lease in
    between (the lease object is the one it saw before
    reading: every maintenance run, of any release, takes the lease before committing), and
    reads again otherwise.
    """

    def __init__(self, dfs: DatasetFS, location: str) -> None:
        self._dfs = dfs
        self._location = location
        self._lease: Lease | None = None
        self._object: Conditional = conditional_object(dfs, location, CHECKPOINT)
        #: Seconds this run held the lease, over every time it took it (`holding`).
        self.lease_held_s = 0.0
        self.read_again()
        #: What `undo` restores: the merged markers, the checkpoint and the retired units before.
        self._undo: tuple[list[Marker], bytes | None, set[str]] | None = None

    def read_again(self) -> None:
        """Read the checkpoint and the markers (again), without the lease."""
        seen = conditional_object(self._dfs, self._location, LEASE).get()
        #: The lease object's etag before this run read anything (None: there was none).
        self._lease_seen = None if seen is None else seen[1]
        self._read(self._dfs)

    def fresh(self, lease: Lease) -> bool:
        """Whether this run's reading is still the dataset's, `lease` just taken: nobody took
        the lease since the reading (every maintenance run takes it before it commits)."""
        return lease.taken_from == self._lease_seen

    def _read(self, dfs: DatasetFS) -> None:
        got = self._object.get()
        #: The checkpoint as this run last read or wrote it, and the store's etag of it (what
        #: the run's next commit compares against).
        self._raw: bytes | None = None if got is None else got[0]
        self._etag: str | None = None if got is None else got[1]
        body = None if got is None else _parse(got[0])
        self._generation = int(body.get("generation", 0)) if body is not None else 0
        self.loaded = load_markers(dfs, checkpoint=body, repair=True)

    def hold(self, lease: Lease, *, repair: bool = True) -> None:
        """The run holds `lease` now: read again if another run took it since this reading
        (`repair`: write the markers of live units a crashed run committed to the checkpoint
        only)."""
        self._lease = lease
        if lease.taken_from != self._lease_seen:
            self._read(self._dfs)
        dfs = self._dfs
        unlisted = self.loaded.unlisted
        if unlisted and not all(dfs.exists(rel) for m in unlisted for rel in m.files.values()):
            # Not the crash it would be (marker next), but files removed since: not usable.
            self.loaded = load_markers(dfs, checkpoint=None)
        elif unlisted and repair:
            lease.check()
            dfs.put_all({m.rel: m.encode() for m in unlisted})
            self.loaded.names = sorted([*self.loaded.names, *(m.unit for m in unlisted)])
            self.loaded.unlisted = []

    def existing(self) -> set[str]:
        """The units whose markers exist, as this run knows them (retired ones too)."""
        return set(self.loaded.names) | self.loaded.markers.keys()

    def gate(self, marker: Marker) -> None:
        """Commit the merged unit `marker` to the checkpoint before its marker is written
        (`replace_units`'s `before_commit`): raises `LeaseLost` when the run is fenced."""
        self.gate_all([marker])

    def gate_all(self, merged: Sequence[Marker]) -> None:
        """Commit the merged units `merged` to the checkpoint in one write, before their
        markers are written (`_merge.commit`'s gate): raises `LeaseLost` when the run is
        fenced."""
        before = self._raw
        self.commit({**self.loaded.markers, **{m.unit: m for m in merged}})
        self._undo = (list(merged), before, set(self.loaded.retired))
        for m in merged:
            self.loaded.markers[m.unit] = m
            self.loaded.retired.update(m.retires)

    def undo(self) -> bool:
        """Put back the checkpoint as it was before the last `gate_all` (their markers could not
        be written); False when that failed (then the checkpoint names the merged units, whose
        data files must stay: the next run writes their markers)."""
        if self._undo is None:
            return False
        merged, before, retired = self._undo
        try:
            if before is None:
                self._object.remove()  # this run created it, holding the lease
                etag = None
            else:
                etag = self._object.replace(before, self._etag or "")
                if etag is None:
                    return False
        except Exception:
            return False
        self._raw, self._etag, self._undo = before, etag, None
        for m in merged:
            self.loaded.markers.pop(m.unit, None)
        self.loaded.retired = retired
        return True

    def commit(self, markers: Mapping[str, Marker]) -> None:
        """Write the checkpoint of `markers` (the run's view: live and retired units), if it
        is unchanged since this run read or last wrote it; raise `LeaseLost` (nothing written)
        when another run wrote it meanwhile."""
        lease = self._lease
        assert lease is not None, "commit while holding the lease (`hold`)"
        lease.check()
        listed = self.existing()
        retired_at = self.loaded.retired_at(markers.values())
        live = [markers[u] for u in sorted(markers) if u not in retired_at]
        # Every name this run listed that sorts before the horizon is in `units` or `retired`.
        after = horizon_before(max(self.loaded.listed_at_ns, self.loaded.last_order()))
        self._generation += 1
        body = orjson.dumps(
            {
                "format": _FORMAT,
                "generation": self._generation,
                "written_at_ms": int(time.time() * 1000),
                "writer": lease.holder,
                "units": [orjson.loads(m.encode()) for m in live],
                "retired": {
                    u: ms for u, ms in sorted(retired_at.items()) if u in listed or u in markers
                },
                "listed_after": after,
            }
        )
        if self._etag is None:
            etag = self._object.create(body)
        else:
            etag = self._object.replace(body, self._etag)
        if etag is None:
            raise LeaseLost(
                f"{lease.purpose} stopped: another maintenance run committed to "
                f"{self._dfs.path(CHECKPOINT)} after this one read it (this run stalled past "
                "its lease); nothing more was committed, run it again"
            )
        self._raw, self._etag = body, etag


#: How many times a run takes the lease and, finding its reading stale, releases it to read again
#: (`holding`); the last time it reads again holding it.
_TAKES = 3


@contextlib.contextmanager
def holding(
    checkpoint: Checkpoint,
    purpose: str,
    *,
    ttl_s: float,
    wait_s: float = 0.0,
    repair: bool = True,
) -> Iterator[Lease]:
    """Hold the maintenance lease for the block with `checkpoint` read as the dataset is now
    (`Checkpoint.hold`). When another run took the lease since the checkpoint's reading (it may
    have committed), the lease is released, the checkpoint read again without it (a listing of
    every marker: seconds on a store of many units) and the lease taken again, so the lease is
    held for a listing only when that happens `_TAKES` times in a row. Adds the time held to
    `Checkpoint.lease_held_s`."""
    for take in range(1, _TAKES + 1):
        lease_held = maintenance_lease(
            checkpoint._location, purpose, ttl_s=ttl_s, dfs=checkpoint._dfs, wait_s=wait_s
        )
        lease: Lease | None = None
        try:
            with lease_held as lease:
                if checkpoint.fresh(lease) or take == _TAKES:
                    checkpoint.hold(lease, repair=repair)
                    yield lease
                    return
        finally:
            if lease is not None:  # released: its whole hold
                checkpoint.lease_held_s += lease.held_s
        checkpoint.read_again()
