"""``inspect --follow``: the calls that arrived since the last look, as rollout-view entries."""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from ..read.reader import Store
from ..schemas.tokens import full_sequence
from .shapes import CallEntry
from .views import failure_entry, staged_entry

__all__ = ["Follower", "known_call_ids"]


def known_call_ids(store: Store, rollout_ids: Iterable[str]) -> set[str]:
    """Call ids already in the store (staged anywhere, failed in `rollout_ids`): the baseline
    ``--follow`` reports new calls against."""
    seen = set(store.source.all_keys())
    for rollout_id in rollout_ids:
        seen.update(f.call_id for f in store.failures(rollout_id))
    return seen


#: Parent sequences `Follower` keeps to tell drift without re-reading them.
_FOLLOW_CACHE = 256


class Follower:
    """Finds the calls that arrived since the last `poll` (staged, or failed in the ledger).

    `poll` returns them as rollout-view entries (docs/inspect.md), ordered by rollout and seq.
    Staged calls are found by diffing the store's keys, so a poll reads only the new records
    (and a new call's parent, to tell drift); failures are read from each followed rollout's
    ledger.
    """

    def __init__(self, store: Store, rollout_id: str | None = None) -> None:
        self.store = store
        self.rollout_id = rollout_id
        self.seen = known_call_ids(store, self._rollout_ids())
        self._parents: dict[str, tuple[int, array[int]]] = {}

    def _rollout_ids(self) -> list[str]:
        return [self.rollout_id] if self.rollout_id is not None else self.store.rollouts()

    def _remember(self, call_id: str, seq: int, full: array[int]) -> None:
        self._parents[call_id] = (seq, full)
        while len(self._parents) > _FOLLOW_CACHE:
            del self._parents[next(iter(self._parents))]

    def _parent(self, call_id: str | None) -> tuple[int, array[int]] | None:
        if call_id is None:
            return None
        if call_id not in self._parents:
            try:
                (p,) = self.store.source.fetch([call_id])
            except KeyError:
                return None
            self._remember(
                call_id, p.seq, full_sequence(p.prompt_token_ids, p.completion_token_ids)
            )
        return self._parents[call_id]

    def seq_of(self, call_id: str) -> int | None:
        hit = self._parents.get(call_id)
        return hit[0] if hit is not None else None

    def poll(self) -> list[CallEntry]:
        new_keys = [k for k in self.store.source.all_keys() if k not in self.seen]
        self.seen.update(new_keys)
        records = self.store.source.fetch(new_keys) if new_keys else []
        orphaned = self.store.source.orphaned() if records else set()
        entries: list[CallEntry] = []
        for r in sorted(records, key=lambda r: (r.rollout_id, r.seq)):
            if self.rollout_id is not None and r.rollout_id != self.rollout_id:
                continue
            parent = self._parent(r.parent_call_id)
            entries.append(
                staged_entry(r, parent[1] if parent else None, orphaned=r.call_id in orphaned)
            )
            self._remember(
                r.call_id, r.seq, full_sequence(r.prompt_token_ids, r.completion_token_ids)
            )
        for rollout_id in self._rollout_ids():
            for f in self.store.failures(rollout_id):
                if f.call_id not in self.seen:
                    self.seen.add(f.call_id)
                    entries.append(failure_entry(f))
        entries.sort(key=lambda e: (e["rollout_id"], e["seq"]))
        return entries
