"""`Store`'s reads of one rollout (or of records by key), verified: its records (`calls`), its
trajectory, a call's routed experts, what is wrong with it (`check`), records by key (`fetch`).

A rollout is read as a whole and verified as a whole (`capture_proxy.read.integrity`), read
once more before it is refused. Bound as `Store` methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..schemas.digest import DigestMismatch, verify_record
from ..schemas.records import CommitCoords, StagedCallRecord
from ..sinks.base import StoreDamaged
from .integrity import RolloutUnverified, rollout_problems
from .status import RolloutFacts, check_included, status_of

if TYPE_CHECKING:
    from .reader import Store
    from .trajectory import Trajectory

__all__ = [
    "calls",
    "check",
    "fetch",
    "problems_of",
    "read_rollout",
    "routed_experts",
    "stored_records",
    "trajectory",
    "verified",
]


def _key_of(item: str | CommitCoords | Mapping[str, Any]) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, CommitCoords):
        return item.staging_key
    return str(item["staging_key"])


def calls(
    store: Store,
    rollout_id: str,
    *,
    include_orphaned: bool = False,
    include_open: bool = False,
    include_poisoned: bool = False,
    verify: bool = True,
) -> list[StagedCallRecord]:
    """The rollout's staged records in sequence order (failures are not records).

    Raises `RolloutExcluded` for an open rollout unless `include_open`, for a poisoned one
    unless `include_poisoned`, `RolloutUnverified` for one that does not verify (unless
    ``verify=False``; `capture_proxy.read.integrity`), KeyError for an unknown one.
    `include_orphaned` adds records marked orphaned (they poison their rollout, so it needs
    `include_poisoned` too).
    """
    facts = RolloutFacts.read(store.source, rollout_id)
    check_included(
        rollout_id,
        status_of(facts),
        include_open=include_open,
        include_poisoned=include_poisoned,
    )
    records = store._records(rollout_id, include_orphaned, verify)
    if verify:
        records = store._verified(facts, records, include_orphaned, None)[1]
    return records


def stored_records(
    store: Store, rollout_id: str, include_orphaned: bool, verify: bool
) -> list[StagedCallRecord]:
    """The rollout's records as stored; a store too damaged to decode them (`StoreDamaged`)
    is, for a verified read, a rollout that does not verify."""
    try:
        return store.source.calls(rollout_id, include_orphaned=include_orphaned)
    except StoreDamaged as e:
        if not verify:
            raise
        raise RolloutUnverified(rollout_id, [str(e)]) from e


def check(store: Store, rollout_id: str, *, expected_head: str | None = None) -> list[str]:
    """Everything wrong with the rollout as a trainer would read it ([] when it verifies):
    the checks `verify=True` makes (`capture_proxy.read.integrity`), orphaned records
    included. `expected_head` is the rollout's chain head as its driver kept it (the seal
    or outcome answer's ``chain_head``). KeyError for an unknown rollout."""
    facts = RolloutFacts.read(store.source, rollout_id)
    records = store.source.calls(rollout_id, include_orphaned=True)
    return store._problems_of(facts, records, expected_head)


def problems_of(
    store: Store,
    facts: RolloutFacts,
    records: list[StagedCallRecord],
    expected_head: str | None,
) -> list[str]:
    return rollout_problems(
        facts,
        records,
        lambda keys: [c.digest for c in store.source.coords(keys)],
        expected_head=expected_head,
        digester=store._digester,
        encoder=store._encoder,
    )


def verified(
    store: Store,
    facts: RolloutFacts,
    records: list[StagedCallRecord],
    include_orphaned: bool,
    expected_head: str | None,
) -> tuple[RolloutFacts, list[StagedCallRecord]]:
    """The rollout's facts and records once they verify; `RolloutUnverified` otherwise.

    The facts and the records are separate reads: a call staged between them (an open
    rollout, read while its proxy writes) or an outcome stored between them would read as
    a record or an outcome the chain does not account for. So a rollout that fails is read
    once more, and fails only when the second read fails too."""
    problems = store._problems_of(facts, records, expected_head)
    if problems:
        facts = RolloutFacts.read(store.source, facts.rollout_id)
        records = store._records(facts.rollout_id, include_orphaned, True)
        problems = store._problems_of(facts, records, expected_head)
        if problems:
            raise RolloutUnverified(facts.rollout_id, problems)
    return facts, records


def fetch(
    store: Store, items: Iterable[str | CommitCoords | Mapping[str, Any]]
) -> list[StagedCallRecord]:
    """One verified record per key or coordinate, in order.

    Raises `KeyError` for a missing key and `DigestMismatch` when stored bytes no longer
    match their digest, or when a coordinate's digest differs from the stored record's.
    """
    items = list(items)
    records = store.source.fetch([_key_of(i) for i in items])
    for item, record in zip(items, records, strict=True):
        verify_record(record, digester=store._digester, encoder=store._encoder)
        want = (
            item.digest
            if isinstance(item, CommitCoords)
            else (item.get("digest") if isinstance(item, Mapping) else None)
        )
        if want is not None and want != record.digest:
            raise DigestMismatch(record.staging_key, "coordinate digest", want, record.digest)
    return records


def trajectory(
    store: Store,
    rollout_id: str,
    *,
    include_untooled: bool = False,
    include_open: bool = False,
    include_poisoned: bool = False,
    verify: bool = True,
    expected_head: str | None = None,
) -> Trajectory:
    """The rollout as one training episode; see `capture_proxy.read.trajectory.Trajectory`.

    Raises like `calls`: `RolloutExcluded` for an open or poisoned rollout not asked for,
    `RolloutUnverified` for one that does not verify, KeyError for an unknown one.
    `expected_head` (the seal or outcome answer's ``chain_head`` its driver kept) refuses
    the rollout unless its stored chain ends there (checked only with ``verify=True``).
    """
    return read_named(
        store,
        rollout_id,
        include_untooled=include_untooled,
        include_open=include_open,
        include_poisoned=include_poisoned,
        verify=verify,
        expected_head=expected_head,
    )[1]


def read_named(
    store: Store,
    rollout_id: str,
    *,
    include_untooled: bool = False,
    include_open: bool = False,
    include_poisoned: bool = False,
    verify: bool = True,
    expected_head: str | None = None,
) -> tuple[list[StagedCallRecord], Trajectory]:
    """`trajectory` with the records it was built from (read once, verified with it), for
    readers that need both: the trainer adapters' `read_episode`."""
    facts = RolloutFacts.read(store.source, rollout_id)
    check_included(
        rollout_id,
        status_of(facts),
        include_open=include_open,
        include_poisoned=include_poisoned,
    )
    return store._read(facts, include_untooled, verify, expected_head)


def read_rollout(
    store: Store,
    facts: RolloutFacts,
    include_untooled: bool,
    verify: bool,
    expected_head: str | None = None,
) -> tuple[list[StagedCallRecord], Trajectory]:
    """The rollout's records and its trajectory, with the driver's outcome on it: the one
    place trajectories are built for `trajectory`, `iter_trajectories` and the export.
    Raises `RolloutUnverified` (``verify=True``) when the rollout does not verify."""
    from .trajectory import trajectory_from_records

    records = store._records(facts.rollout_id, False, verify)
    if verify:
        facts, records = store._verified(facts, records, False, expected_head)
    # The status carries the driver's latest outcome: the trajectory's reward and group.
    traj = trajectory_from_records(
        facts.rollout_id, records, include_untooled=include_untooled, status=status_of(facts)
    )
    return records, traj


def routed_experts(
    store: Store,
    call_id: str,
    *,
    include_open: bool = False,
    include_poisoned: bool = False,
    verify: bool = True,
    allow_incomplete: bool = False,
    expected_head: str | None = None,
) -> str | None:
    """The call's routed experts over its whole prompt + completion, or None when its record
    has none (vLLM without ``--enable-return-routed-experts``).

    A record stores only the rows its parent did not (`capture_proxy.read.experts`); this
    rebuilds the full array, as vLLM encodes it: a base64 ``.npy`` string whose first axis
    is the position. With ``verify=True`` the call's rollout must verify as a whole, as for
    `trajectory` (`capture_proxy.read.integrity`; `expected_head` anchors it): the rows come
    from the records it verified. Raises like `calls` (`RolloutExcluded`,
    `RolloutUnverified`, KeyError, `DigestMismatch`), `ExpertsIncomplete` when the call is
    flagged ``routed_experts_incomplete`` (unless `allow_incomplete`: then the rows before
    its start are its parent's) and `ExpertsUnavailable` when a record of the chain is
    missing.
    """
    from .experts import assemble_experts

    (asked,) = store.source.fetch([call_id])  # KeyError when no record has the id
    facts = RolloutFacts.read(store.source, asked.rollout_id)
    check_included(
        facts.rollout_id,
        status_of(facts),
        include_open=include_open,
        include_poisoned=include_poisoned,
    )
    records = store._records(facts.rollout_id, True, verify)
    if verify:
        records = store._verified(facts, records, True, expected_head)[1]
    verified = {r.call_id: r for r in records}

    def fetch(key: str) -> StagedCallRecord:
        found = verified.get(key)
        if found is not None:
            return found
        # A parent in another rollout (none is written so): its digest at least.
        (found,) = store.fetch([key]) if verify else store.source.fetch([key])
        return found

    return assemble_experts(fetch, fetch(call_id), allow_incomplete=allow_incomplete)
