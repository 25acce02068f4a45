"""`Store`'s reads over many rollouts: which rollouts the trainer-facing filters keep, in
export order (`SelectedRollout`), and the iterating reads over them (`iter_trajectories`,
`iter_read`), one rollout in memory at a time. Bound as `Store` methods.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ..schemas.records import RolloutInfo, RolloutState, StagedCallRecord
from ..sinks.base import StoreDamaged
from ..sinks.rollout_index import RolloutQuery, indexed
from .integrity import RolloutUnverified
from .status import (
    RolloutExcluded,
    RolloutFacts,
    RolloutStatus,
    check_included,
    read_header,
    status_of,
)

if TYPE_CHECKING:
    from .cursor import ExportCursor
    from .reader import Store
    from .trajectory import Trajectory

__all__ = [
    "RewardView",
    "SelectedRollout",
    "as_epoch_ms",
    "iter_read",
    "iter_trajectories",
    "select",
    "take",
]

log = logging.getLogger("capture_proxy.read")


def select(
    store: Store,
    *,
    include_open: bool,
    include_poisoned: bool,
    since: int | datetime | None,
    group: str | Iterable[str] | None,
    rollouts: Iterable[str] | None,
    skipped: dict[str, list[str]] | None,
    cursor: ExportCursor | None = None,
    expected_heads: Mapping[str, str] | None = None,
    unverified: dict[str, list[str]] | None = None,
) -> list[SelectedRollout]:
    """The rollouts the filters keep, in export order: oldest first, except that the
    rollouts of one group follow each other (at the place of the group's oldest rollout),
    so a GRPO group is adjacent. Reads headers and ledgers only, no records; none for the
    rollouts `cursor` already took."""
    since_ms = as_epoch_ms(since)
    groups = {group} if isinstance(group, str) else None if group is None else set(group)
    if rollouts is None and (groups is not None or (since_ms is not None and not include_open)):
        # The rollout index narrows first: the reads below follow what is kept, not the
        # store. (An open rollout has no seal time: with include_open, `since` cannot.)
        query = RolloutQuery(
            since_ms=None if include_open else since_ms,
            groups=None if groups is None else frozenset(groups),
        )
        ids = [r.rollout_id for r in indexed(store.source, query)]
    elif rollouts is None:
        ids = store.rollouts()
    else:
        known = store.rollouts()
        wanted = set(rollouts)
        missing = sorted(wanted.difference(known))
        if missing:
            raise KeyError(f"no rollout {', '.join(map(repr, missing))} in {store.url}")
        ids = [r for r in known if r in wanted]
    if expected_heads is not None:
        # An anchored read takes the rollouts its driver vouches for, and says which of
        # those the store lost and which others it holds.
        if skipped is not None:
            gone = sorted(set(expected_heads).difference(store.source.rollouts()))
            skipped.setdefault("missing", []).extend(gone)
            skipped.setdefault("unanchored", []).extend(r for r in ids if r not in expected_heads)
        ids = [r for r in ids if r in expected_heads]
    kept: list[SelectedRollout] = []
    if cursor is not None:
        ids = [r for r in ids if r not in cursor]
    for rollout_id in ids:
        # One header read per rollout: its outcome, its seal time and its status.
        try:
            header = read_header(store.source, rollout_id)
        except StoreDamaged as e:
            log.warning("left out: rollout %r: %s", rollout_id, e)
            if skipped is not None:
                skipped.setdefault("unverified", []).append(rollout_id)
            if unverified is not None:
                unverified[rollout_id] = [str(e)]
            continue
        outcome = RewardView.of(header)
        if groups is not None and outcome.group_id not in groups:
            continue
        sealed_at = None if header is None else header.sealed_at_ms
        # `since` compares the seal time the writing proxy decided, not when the seal became
        # visible here (the cursor is the exact way). An open rollout (no seal time yet) is
        # kept when open rollouts are asked for.
        if since_ms is not None and sealed_at is not None and sealed_at < since_ms:
            continue
        try:
            facts = RolloutFacts.read(store.source, rollout_id, header)
        except StoreDamaged as e:
            # Its ledger or event log cannot be decoded: it does not verify, whatever the
            # filters (a verified read would refuse it; an unverified one cannot read it).
            log.warning("left out: rollout %r: %s", rollout_id, e)
            if skipped is not None:
                skipped.setdefault("unverified", []).append(rollout_id)
            if unverified is not None:
                unverified[rollout_id] = [str(e)]
            continue
        status = status_of(facts)
        try:
            check_included(
                rollout_id, status, include_open=include_open, include_poisoned=include_poisoned
            )
        except RolloutExcluded as e:
            if skipped is not None:
                why = "poisoned" if e.keyword == "include_poisoned" else "open"
                skipped.setdefault(why, []).append(rollout_id)
            continue
        kept.append(SelectedRollout(rollout_id, status, sealed_at, outcome, facts))
    # Each rollout sorts at the place of its group's first rollout (its own place when it
    # has no group): groups stay together, everything else keeps the store's order.
    first: dict[str, int] = {}
    places = [
        first.setdefault(s.outcome.group_id, i) if s.outcome.group_id is not None else i
        for i, s in enumerate(kept)
    ]
    order = sorted(range(len(kept)), key=lambda i: (places[i], i))
    return [kept[i] for i in order]


def iter_trajectories(
    store: Store,
    *,
    include_untooled: bool = False,
    include_open: bool = False,
    include_poisoned: bool = False,
    verify: bool = True,
    since: int | datetime | None = None,
    group: str | Iterable[str] | None = None,
    skipped: dict[str, list[str]] | None = None,
    cursor: ExportCursor | None = None,
    expected_heads: Mapping[str, str] | None = None,
    unverified: dict[str, list[str]] | None = None,
) -> Iterator[Trajectory]:
    """Every rollout's trajectory, oldest rollout first, one rollout in memory at a time.

    The rollouts of one group (`Trajectory.group_id`) come one after the other, at the place
    of the group's oldest rollout. Open rollouts (unless `include_open`), poisoned ones
    (unless `include_poisoned`) and ones that do not verify (unless ``verify=False``:
    `capture_proxy.read.integrity`) are left out; pass a dict as `skipped` to learn which:
    it gets ``"open"``, ``"poisoned"`` and ``"unverified"`` lists of rollout ids (a rollout
    both open and poisoned is counted as poisoned), and a dict as `unverified` to learn
    why: rollout id -> its problems. Each rollout left out as unverified is also logged as
    a warning (logger ``capture_proxy.read``). `group` (a group id, or several) keeps only
    those groups.

    `expected_heads` anchors the read (docs/contract.md, "Anchored reads"): rollout id ->
    the ``chain_head`` of the last seal or outcome answer its driver kept
    (`capture_proxy.read.anchors.load_heads` reads a file of them). Only those rollouts are
    read, each only if its stored chain ends at that head (else it is unverified); the
    store's other rollouts are listed in ``skipped["unanchored"]``, and the anchored ones
    the store does not hold in ``skipped["missing"]``.

    A training loop that reads incrementally passes the same `cursor`
    (`capture_proxy.read.cursor.ExportCursor`) to every pass: each sealed rollout is then
    yielded exactly once over all passes, however late it became visible in the store. The
    rollouts in the cursor are skipped, and each sealed rollout is added to it as its
    trajectory is yielded (a pass stopped early has taken only what it got; one left out as
    unverified is not taken, so the next pass reads it again).

    `since` (a `datetime`, or milliseconds since the epoch) keeps only rollouts whose seal
    time is at or after it. The seal time is the writing proxy's clock when it sealed, not
    when the seal became visible here: a rollout sealed before `since` but visible only
    after an earlier pass read the store is in neither pass. Use `cursor` to read
    incrementally; `since` selects by time.

    Rollouts without any staged call yield nothing.
    """
    for _, traj in store.iter_read(
        include_untooled=include_untooled,
        include_open=include_open,
        include_poisoned=include_poisoned,
        verify=verify,
        since=since,
        group=group,
        skipped=skipped,
        cursor=cursor,
        expected_heads=expected_heads,
        unverified=unverified,
    ):
        yield traj


def iter_read(
    store: Store,
    *,
    rollouts: Iterable[str] | None = None,
    include_untooled: bool = False,
    include_open: bool = False,
    include_poisoned: bool = False,
    verify: bool = True,
    since: int | datetime | None = None,
    group: str | Iterable[str] | None = None,
    skipped: dict[str, list[str]] | None = None,
    cursor: ExportCursor | None = None,
    expected_heads: Mapping[str, str] | None = None,
    unverified: dict[str, list[str]] | None = None,
) -> Iterator[tuple[list[StagedCallRecord], Trajectory]]:
    """`iter_trajectories` with each trajectory's records, read once and verified with it
    (for readers that need the records too, as the trainer adapters do); `rollouts` keeps
    those rollouts only (KeyError for one the store does not hold)."""
    selected = store._select(
        include_open=include_open,
        include_poisoned=include_poisoned,
        since=since,
        group=group,
        rollouts=rollouts,
        skipped=skipped,
        cursor=cursor,
        expected_heads=expected_heads,
        unverified=unverified,
    )
    for sel in selected:
        got = store._take(sel, include_untooled, verify, expected_heads, skipped, unverified)
        if got is None:
            continue
        records, traj = got
        if cursor is not None and sel.status.state is RolloutState.SEALED:
            cursor.add((sel.rollout_id,))
        if traj.calls or traj.apart:
            yield records, traj


def take(
    store: Store,
    sel: SelectedRollout,
    include_untooled: bool,
    verify: bool,
    expected_heads: Mapping[str, str] | None,
    skipped: dict[str, list[str]] | None,
    unverified: dict[str, list[str]] | None,
) -> tuple[list[StagedCallRecord], Trajectory] | None:
    """A selected rollout's records and trajectory, or None when it does not verify (then
    said in `skipped`, `unverified` and the log): the iterating reads' and the export's."""
    facts = sel.facts or RolloutFacts.read(store.source, sel.rollout_id)
    head = None if expected_heads is None else expected_heads[sel.rollout_id]
    try:
        return store._read(facts, include_untooled, verify, head)
    except KeyError:
        return None  # removed since it was selected (gc): nothing left to read
    except RolloutUnverified as e:
        log.warning("left out: %s", e)
        if skipped is not None:
            skipped.setdefault("unverified", []).append(sel.rollout_id)
        if unverified is not None:
            unverified[sel.rollout_id] = list(e.problems)
        return None


@dataclass(frozen=True, slots=True)
class RewardView:
    """The reward and group of a rollout's latest outcome, as trainers read them: `reward` is
    None when the driver sent an object of numbers (then `reward_components` holds them)."""

    reward: float | None = None
    reward_components: dict[str, float] | None = None
    group_id: str | None = None

    @staticmethod
    def of(header: RolloutInfo | None) -> RewardView:
        """The latest outcome of a rollout header (none without a header or an outcome)."""
        outcome = None if header is None else header.outcome
        if outcome is None:
            return _NO_OUTCOME
        return RewardView(outcome.scalar_reward, outcome.reward_components, outcome.group_id)


_NO_OUTCOME = RewardView()


@dataclass(frozen=True, slots=True)
class SelectedRollout:
    """A rollout the trainer-facing filters keep, with what was read to decide it."""

    rollout_id: str
    status: RolloutStatus
    sealed_at_ms: int | None
    outcome: RewardView
    #: What was read to decide it (its ledger, summaries and event log), checked again by
    #: the read that takes it.
    facts: RolloutFacts | None = None


def as_epoch_ms(when: int | datetime | None) -> int | None:
    """`since` as milliseconds since the epoch (a naive datetime is taken as UTC)."""
    if when is None or (isinstance(when, int) and not isinstance(when, bool)):
        return when
    if isinstance(when, datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return int(when.timestamp() * 1000)
    raise TypeError(f"since must be a datetime or milliseconds since the epoch, not {when!r}")
