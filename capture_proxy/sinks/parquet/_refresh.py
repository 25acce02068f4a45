"""How a `ParquetSource` keeps its index up to date with the store, and how its reads share it.

A reader lists the commit markers, reads the markers of the units it has not seen, and indexes
those units (`_index`). The reads of a reader shared by a proxy's threads (resumes, the writer's
read-ahead, the follower, read routes) do not wait for each other:

* Any number of reads run at once: they hold the index's lock shared (`_rwlock.SharedLock`)
  while they look at the index and load rows (through caches with locks of their own).
* One refresh at a time lists the store and reads what it found (markers, the new units' files)
  holding no lock reads take; it takes the index's lock alone only to apply what it read, unit
  chunk by unit chunk (no request is made meanwhile). A re-index after a compaction builds the
  new index beside the old one and swaps it in: reads go on with the old one meanwhile.
* A read asks for a listing at least as new as itself (what was committed before it is read),
  not a listing of its own: reads asking while a refresh is under way wait for it and share the
  next one (a burst of reads lists the store once or twice, not once each).

A long-lived reader's listings start at a horizon of its own, as an open's start at a maintenance
run's checkpoint horizon (docs/storage.md, "A long-lived reader's own horizon"): once a listing
has shown it every name, a marker named more than `COMMIT_MARGIN_S` before that listing began
cannot land any more, so the next listing asks only for the names after that point. A proxy's
reader re-lists every 5 s; on a dataset nobody compacts it otherwise listed, sorted and compared
every marker ever committed each time (39,000 names, some MB of strings made and dropped every
5 s after half an hour of a soak), a cost that grew for as long as the proxy ran.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from ..base import PROXY_STATE_ROLLOUT
from ..rollout_index import IndexedRollout
from ._checkpoint import CHECKPOINT, Loaded, load_markers
from ._directory import Directory
from ._index import Index, Locator, UnitIndex
from ._layout import Marker, horizon_before, list_markers
from ._loading import Loading
from ._read_errors import damaged as _damaged
from ._read_errors import vanished as _vanished
from ._rwlock import SharedLock
from ._snapshot import fetched_ahead, read_markers
from ._unit_names import UnitNames

__all__ = ["Refreshing"]

T = TypeVar("T")
#: Reads retried when files vanish under them (each retry follows a compaction's cleanup).
_ATTEMPTS = 5


class Refreshing(Loading):
    """The snapshot half of `ParquetSource` (see the module docstring)."""

    url: str
    _object_url: str | None
    _per_unit: bool
    _call_keys: bool
    _collect_heads: bool
    _directory: Directory | None

    def _start(self) -> None:
        #: Reads hold it shared; a change of the index (`_apply`) alone.
        self._rw = SharedLock()
        #: One refresh (listing, reading, applying) at a time; a reset takes it too.
        self._refreshing = threading.Lock()
        #: Held while the rollout index (`_directory`) is built, queried or changed.
        self._directory_lock = threading.Lock()
        #: Per thread: how deep in `snapshot` blocks it is (reads inside one do not re-list).
        self._blocks = threading.local()
        #: Counts index swaps and resets: a read that found a file gone resets the reader only
        #: if no other thread replaced its index since the read began.
        self._generation = 0
        self._listing = UnitNames()  # the names the last listing returned, packed
        #: Whether the units are indexed (a first `refresh` opened the dataset).
        self._opened = False
        #: The horizon of the checkpoint the open used: later listings start after it too, and
        #: the highest unit order the open knew of (`_checkpoint`).
        self._after: str | None = None
        self._known_order = 0
        #: The checkpoint's `DatasetFS.tag` when the open read it: a maintenance run wrote
        #: another since when it differs (then the reader opens again: what it retired may be
        #: before the horizon, where listings do not look).
        self._checkpoint_tag: str | None = None
        #: When the last listing was started (`time.monotonic`).
        self._listed_at = float("-inf")
        #: Whether listings may start after a horizon of the reader's own (`_roll`): not while
        #: a checkpoint is there but was not used (a crash between its write and its merged
        #: unit's marker), since the marker the next maintenance run writes for that unit takes
        #: an old order, which only a listing of every name shows.
        self._rolls = True
        #: The names of the indexed (live) units, in the index's order.
        self._units = UnitNames()

    def _index_row(self, rollout_id: str) -> IndexedRollout:
        raise NotImplementedError

    # -- refresh --------------------------------------------------------------------------------

    def refresh(self, max_age_s: float = 0.0) -> None:
        """Pick up units committed (or retired) since the last call (with `max_age_s`: unless
        this reader listed the store less than that many seconds ago). While another thread
        refreshes the reader, this waits for it, and lists again only if that listing began
        too early.

        Raises FileNotFoundError when a listed unit's files were deleted meanwhile (a compaction
        cleaning up); the reader is then reset, and the next refresh starts over.
        """
        self._refresh(time.monotonic() - max_age_s)

    def _refresh(self, since: float) -> None:
        """Index what a listing begun at `since` or later shows."""
        with self._refreshing:
            if self._opened and self._listed_at >= since:
                return  # (another thread listed the store meanwhile)
            listed_at = time.monotonic()  # when the listing started: its age is not less
            listed_ns = time.time_ns()  # (the same instant, on the clock unit names use)
            tag = self.dfs.tag(CHECKPOINT)
            loaded = None
            if not self._opened or tag != self._checkpoint_tag:
                # An open: the checkpoint's live units, and the markers of units committed
                # since (a retired unit's marker is not read; names before the checkpoint's
                # horizon are not even listed: `_checkpoint`). Read again when a maintenance
                # run wrote another checkpoint: a unit it merged or removed may be before the
                # horizon, where no listing looks.
                loaded = load_markers(self.dfs, None, self._object_url)
                names = loaded.names
                listed_ns = loaded.listed_at_ns or listed_ns
                self._rolls = tag is None or loaded.checkpoint is not None
            else:
                names = list_markers(self.dfs, self._after)
                if len(names) == len(self._listing) and self._listing.is_prefix_of(names):
                    self._listed_at = listed_at
                    self._roll(names, listed_ns)
                    return
            try:
                self._load(names, loaded)
                self._checkpoint_tag = tag
                self._listed_at = listed_at
                self._roll(names, listed_ns)
            except BaseException as e:
                with self._rw.exclusive():
                    self._reset()
                damaged = _damaged(self.url, e)
                if damaged is not None:
                    raise damaged from e
                raise

    @contextlib.contextmanager
    def snapshot(self, max_age_s: float = 0.0) -> Iterator[None]:
        """Read the dataset as of a listing taken when the block starts: the calls inside it
        (on this thread) do not re-list the commit markers each. With `max_age_s`, a listing
        this reader took less than that many seconds ago is used as it is (on object storage a
        listing is a request per thousand markers).

        The block holds nothing other threads wait for: their reads, and the writer's
        follower, go on; units another thread indexes meanwhile may show inside the block.
        A file a compaction deleted under the block is handled as outside one: the read
        re-lists and retries.
        """
        self._refresh(time.monotonic() - max_age_s)
        depth: int = getattr(self._blocks, "depth", 0)
        self._blocks.depth = depth + 1
        try:
            yield
        finally:
            self._blocks.depth = depth

    def _load(self, names: list[str], loaded: Loaded | None = None) -> None:
        """Index the units `names` shows that the reader has not (and drop those retired):
        the requests first, holding nothing reads wait for, then `_apply` in chunks."""
        listed = self._listing
        # The writer's steady state: names only appended (each refresh of a proxy's reader
        # would otherwise compare and sort every marker, a cost that grows with the store).
        appended = listed.is_prefix_of(names)
        if appended:
            fresh = names[len(listed) :]
        else:
            # Only the markers not read yet are read: the others' units are indexed (their
            # names in `_units`) or were left out as retired, and markers never change. A
            # compaction's retired markers stay listed for its grace period, and several
            # writers' units land out of name order all the time: reading every listed marker
            # again on each of those refreshes cost a request per unit of the store.
            seen = set(listed)
            fresh = [n for n in names if n not in seen]
        # Concurrent on object storage; one removed by a compaction's cleanup after it was
        # listed is left out.
        units_in = fresh
        after, known_order = self._after, self._known_order
        if loaded is None:
            markers = read_markers(self.dfs, fresh, self._object_url)
            retired = {u for m in markers.values() for u in m.retires}
        else:
            markers, retired = loaded.markers, loaded.retired
            after, known_order = loaded.after, loaded.last_order()
            # The checkpoint's live units before its horizon are not listed: indexed too (those
            # not indexed yet, when the reader was open already).
            have = set(self._units)
            units_in = sorted({*fresh, *markers} - have)
        # What the new markers retire (a compaction's or gc's merged unit), and units whose
        # markers are gone (deleted by a cleanup once retired, by a marker read before or not).
        if not appended:
            # (Before the horizon nothing is listed: a unit there leaves when a marker read
            # retires it, or when its files are gone and the reader opens again.)
            now, horizon = set(names), after or ""
            retired.update(u for u in self._units if u not in now and u > horizon)
        # Their markers are not kept: a reader that lives as long as a proxy sees a unit every
        # few calls, and the index holds what it needs of each (its files).
        added = [markers[n] for n in units_in if n in markers and n not in retired]
        if not retired or retired.isdisjoint(self._units):
            # New units, replacing none of those indexed: they are indexed after them (another
            # writer's units may land between ones indexed: nothing was replaced, so ledger
            # rows replay as before). Into the index reads use: each chunk applied alone.
            self._stop_collecting()
            self._after, self._known_order = after, known_order
            units = self._units
            # A units index takes new units while it is read (`UnitIndex.add_unit`); the lock
            # is held shared all the same, so no swap or reset happens meanwhile. A calls index
            # (bulk reads: no proxy shares it) is changed alone.
            shared = isinstance(self._index, UnitIndex)
            for chunk in self._fetched(added):
                with self._rw.shared() if shared else self._rw.exclusive():
                    self._apply(self._index, chunk, directory=True)
                    units.extend(m.unit for m in chunk)
            with self._rw.exclusive() if not self._opened else self._rw.shared():
                self._publish(names, fresh, appended)
            return
        # A compaction replaced units: re-index, so ledger rows replay in the new order. The
        # markers of the units still live are read again (not the retired ones). Built beside
        # the index reads use, then swapped in.
        kept = [u for u in self._units if u not in retired]
        unread = [u for u in kept if u not in markers]  # (a checkpoint read has them)
        markers.update(read_markers(self.dfs, unread, self._object_url))
        new = [markers[u] for u in sorted([*kept, *(m.unit for m in added)]) if u in markers]
        self._stop_collecting()
        index = self._new_index()
        for chunk in self._fetched(new):
            self._apply(index, chunk, directory=False)
        with self._rw.exclusive():
            self._index = index
            self._generation += 1
            self._refs.clear()
            self._index_groups.clear()
            self._directory = None  # built again at the next query
            self._after, self._known_order = after, known_order
            self._units = UnitNames(m.unit for m in new)
            self._publish(names, fresh, appended)

    def _stop_collecting(self) -> None:
        # (Reads may run meanwhile: those that take what is collected, `event_heads` and
        # `known`, find it or read the files; only the refresher, holding `_refreshing`,
        # collects.)
        idx = self._index
        if self._opened and isinstance(idx, UnitIndex) and idx.heads is not None:
            # The event heads and rollout ids a writer's open takes (`event_heads`, `known`)
            # are collected by the first load only: a reader nobody takes them from (the
            # proxy's shared one) would otherwise keep one per rollout ever indexed. Taken
            # later, they are read from the files.
            idx.heads = idx.headed = idx.called = idx.attached = None
            self._collect_heads = False

    def _fetched(self, units: list[Marker]) -> Iterator[list[Marker]]:
        """`units` in chunks, each chunk's files fetched (on object storage) while nothing
        reads wait for is held; `dfs.prefetched` holds them while the chunk is yielded."""
        for chunk, files, ahead in fetched_ahead(self.dfs, units, self._object_url):
            self.dfs.prefetched, self.dfs.ahead = files, ahead
            try:
                yield chunk
            finally:
                self.dfs.prefetched, self.dfs.ahead = {}, {}

    def _apply(self, index: Index | UnitIndex, chunk: list[Marker], *, directory: bool) -> None:
        """Index `chunk` into `index` (from the files fetched ahead); with `directory`, the
        rollout index follows the rollouts the chunk has rows of."""
        # (Always tracked: a rollout index built while the chunk is indexed may have missed
        # some of it.)
        touched: dict[str, None] | None = {} if directory else None
        index.touched = touched
        try:
            for unit in chunk:
                if isinstance(index, UnitIndex):
                    index.add_unit(self.dfs, unit)
                else:
                    index.add_unit(self.dfs, unit, self._keep)
        finally:
            index.touched = None
        if touched:
            with self._directory_lock:
                if self._directory is not None:
                    for rollout_id in touched:
                        if rollout_id != PROXY_STATE_ROLLOUT:
                            self._directory.put(self._index_row(rollout_id))

    def _roll(self, names: list[str], listed_ns: int) -> None:
        """After a listing that showed every name after `_after` (`names`, sorted) and was
        indexed, move `_after` up to a point no marker can land before any more: when the
        listing began, on this host's clock, less `COMMIT_MARGIN_S`. A marker that had not
        landed then lands within `COMMIT_LIMIT_S` of the time in its name, on its writer's
        clock, so its name is after that point unless that clock is more than 90 s behind
        this one. (A maintenance run's horizon also takes the highest order listed, since
        other hosts read it: this one is only this reader's.) The names kept for the next
        comparison are those after it."""
        if not self._rolls:
            return
        last = names[-1][:20] if names else ""
        if len(last) == 20 and last.isdigit():
            # (Known once its name leaves `_listing`: a writer names its units after it.)
            self._known_order = max(self._known_order, int(last))
        after = horizon_before(listed_ns)
        if self._after is not None and after <= self._after:
            return
        # (Read only by refreshes, which hold `_refreshing`, as this one does.)
        self._after = after
        self._listing = UnitNames(n for n in names if n > after)

    def _publish(self, names: list[str], fresh: list[str], appended: bool) -> None:
        if appended:
            self._listing.extend(fresh)
        else:
            self._listing = UnitNames(names)
        if not self._opened:
            self._generation += 1
        self._opened = True

    def _new_index(self) -> Index | UnitIndex:
        if not self._per_unit:
            return Index()
        if not self._collect_heads:
            return UnitIndex(calls=Locator() if self._call_keys else None)
        return UnitIndex(
            calls=Locator() if self._call_keys else None,
            heads={},
            headed={},
            called={},
            attached={},
        )

    def _reset(self) -> None:
        """Forget the index (the lock held alone): the next read opens the dataset again."""
        self._generation += 1
        self._directory = None
        self._opened = False
        self._listing = UnitNames()
        self._units = UnitNames()
        self._index = self._new_index()
        self._refs.clear()
        self._index_groups.clear()

    # -- reads ----------------------------------------------------------------------------------

    def _in_block(self) -> bool:
        return bool(getattr(self._blocks, "depth", 0))

    @contextlib.contextmanager
    def _current(self) -> Iterator[int]:
        """Hold the index shared, as of a listing begun now (in a `snapshot` block: its own);
        yields the index's generation."""
        while True:
            if not self._in_block() or not self._opened:
                self._refresh(time.monotonic())
            with self._rw.shared():
                if self._opened:  # (else reset by another thread meanwhile: again)
                    yield self._generation
                    return

    def _read(self, fn: Callable[[], T]) -> T:
        """Run a read on a fresh snapshot; if a file vanished under it, re-list and retry.

        Files vanish only when a compaction deletes units it retired (after a grace period, or
        at once with ``grace_s=0``): re-listing finds the merged unit that replaced them.
        """
        for attempt in range(_ATTEMPTS):
            generation = -1
            try:
                with self._current() as generation:
                    return fn()
            except OSError as e:
                if not isinstance(e, FileNotFoundError) and not _vanished(e):
                    raise
                with self._refreshing, self._rw.exclusive():
                    if self._generation == generation:  # else replaced meanwhile
                        self._reset()
                if attempt == _ATTEMPTS - 1:
                    raise
            except (ValueError, TypeError, OverflowError, UnicodeError, IndexError) as e:
                damaged = _damaged(self.url, e)
                if damaged is None:
                    raise
                raise damaged from e
        raise AssertionError("unreachable")
