"""What a rollout is, beyond its records: open or sealed, its calls that were not staged, poisoned.

A rollout is *poisoned* when a call was answered but not staged: the client got tokens the store
does not hold (``capture_failed``; an ``orphaned`` record, whose write landed after the proxy had
given up on it; ``lost_in_crash``, a call admitted (its seq claimed in the event log) that has
neither a record nor a ledger entry: the proxy stopped while it was in flight). Its trajectory
then misses what the policy generated in that call, and the next calls' prompts hold those tokens
as if they were context. Calls that
were not answered (``upstream_error``, ``rejected``, ``aborted``) are failures too, counted in
`RolloutStatus.n_failures`, but the episode the store holds is still the one the model saw: they
do not poison.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import EllipsisType

from ..errors import CaptureProxyError
from ..schemas.events import RolloutEvent
from ..schemas.outcome import RolloutOutcome
from ..schemas.records import CallStatus, CallSummary, LedgerEntry, RolloutInfo, RolloutState
from ..sinks.base import StagingSource

__all__ = [
    "LOST_IN_CRASH",
    "PARTIAL",
    "POISONING",
    "NotStaged",
    "RolloutExcluded",
    "RolloutFacts",
    "RolloutStatus",
    "check_included",
    "rollout_status",
    "status_of",
]

#: A claimed call with neither a record nor a ledger entry (see `rollout_status`).
LOST_IN_CRASH = "lost_in_crash"
#: Not-staged statuses that poison a rollout: the client was answered, the store has no record.
POISONING = frozenset({CallStatus.CAPTURE_FAILED.value, "orphaned", LOST_IN_CRASH})
#: Not-staged statuses whose call may have delivered part of an answer before it ended: a stream
#: broken by the upstream (``upstream_error``) or left by its client (``aborted``) after its
#: first tokens. They do not poison (nothing the client kept was lost in full: it saw the error),
#: but a client that replays the partial answer puts tokens the policy generated into its next
#: prompt, so trajectories break there (`NotStaged.may_have_answered`).
PARTIAL = frozenset({CallStatus.UPSTREAM_ERROR.value, CallStatus.ABORTED.value})


@dataclass(frozen=True, slots=True)
class NotStaged:
    """A call of the rollout the store holds no usable record of.

    `status` is the ledger's (``capture_failed``, ``upstream_error``, ``rejected``,
    ``aborted``), ``orphaned`` for a record marked orphaned without a ledger entry, or
    ``lost_in_crash`` for a claimed call with neither; `reason` is the ledger's
    machine-readable reason (else the same word as `status`).
    """

    seq: int
    call_id: str
    status: str
    reason: str

    @property
    def poisons(self) -> bool:
        """True when the client was answered: the rollout misses tokens the policy generated."""
        return self.status in POISONING

    @property
    def may_have_answered(self) -> bool:
        """True when the client may hold tokens the policy generated in this call: it was
        answered (`poisons`), or its stream ended early after some (``upstream_error``,
        ``aborted``). A trajectory breaks after such a call (``not_staged``) unless the next
        call is its retry."""
        return self.status in POISONING or self.status in PARTIAL


@dataclass(frozen=True, slots=True)
class RolloutStatus:
    """A rollout's state (open/sealed), whether it is poisoned, its not-staged calls, and the
    outcome its driver sent last (None before any)."""

    state: RolloutState
    poisoned: bool
    not_staged: tuple[NotStaged, ...] = ()
    outcome: RolloutOutcome | None = None

    @property
    def n_failures(self) -> int:
        """Calls of the rollout that were not staged, poisoning or not."""
        return len(self.not_staged)


#: What a trajectory built without the store's ledger says: not known to be sealed.
UNKNOWN = RolloutStatus(RolloutState.OPEN, False)


def read_header(source: StagingSource, rollout_id: str) -> RolloutInfo | None:
    """The rollout's header, or None for calls without one (a store written before headers)."""
    try:
        return source.rollout_info(rollout_id)
    except KeyError:
        return None


@dataclass(frozen=True, slots=True)
class RolloutFacts:
    """What the store holds about a rollout besides its records' content, read once: its
    header, ledger, record summaries, event log and admission claims. Its status
    (`status_of`) and its integrity check (`capture_proxy.read.integrity`) both come from it."""

    rollout_id: str
    header: RolloutInfo | None
    failures: list[LedgerEntry]
    summaries: list[CallSummary]
    events: list[RolloutEvent]
    claims: dict[int, str]

    @staticmethod
    def read(
        source: StagingSource,
        rollout_id: str,
        header: RolloutInfo | EllipsisType | None = ...,
        *,
        claims: bool = True,
    ) -> RolloutFacts:
        """Read them; KeyError for an unknown rollout. A caller that has the header already
        (`read_header`, for a rollout it listed) passes it: then neither the store's rollout
        list nor the header is read again (an export selects every rollout of the store, and a
        list per rollout would make it quadratic). ``claims=False`` leaves the claims unread
        (the integrity check does not use them; on object storage they are a listing each)."""
        if header is ...:
            header = read_header(source, rollout_id)
            # Only a rollout without a header needs the store's list (a store written before
            # headers): listing it for every rollout made each read cost the whole store.
            if header is None and rollout_id not in source.rollouts():
                raise KeyError(rollout_id)
        return RolloutFacts(
            rollout_id,
            header,
            source.failures(rollout_id),
            source.summaries(rollout_id),
            source.events(rollout_id),
            source.claims(rollout_id) if claims else {},
        )


def rollout_status(
    source: StagingSource, rollout_id: str, header: RolloutInfo | EllipsisType | None = ...
) -> RolloutStatus:
    """Read the rollout's header, ledger and orphan marks. KeyError for an unknown rollout.

    A caller that has the header already passes it (see `RolloutFacts.read`)."""
    return status_of(RolloutFacts.read(source, rollout_id, header))


def status_of(facts: RolloutFacts) -> RolloutStatus:
    """The rollout's status from what was read of it (`RolloutFacts`)."""
    header = facts.header
    if header is None:  # not sealed
        state, header_poisoned, outcome = RolloutState.OPEN, False, None
    else:
        state, header_poisoned, outcome = header.state, header.poisoned, header.outcome
    entries = [NotStaged(f.seq, f.call_id, f.status.value, f.reason) for f in facts.failures]
    # A record that landed after its caller gave up is usually in the ledger as well (the
    # caller saw capture_failed): one call, listed once.
    listed = {e.call_id for e in entries}
    entries.extend(
        NotStaged(s.seq, s.call_id, "orphaned", "orphaned")
        for s in facts.summaries
        if s.orphaned and s.call_id not in listed
    )
    entries.extend(_from_event_log(facts, listed, {s.call_id for s in facts.summaries}))
    entries.sort(key=lambda e: e.seq)
    poisoned = header_poisoned or any(e.poisons for e in entries)
    return RolloutStatus(state, poisoned, tuple(entries), outcome)


def _from_event_log(facts: RolloutFacts, listed: set[str], staged: set[str]) -> list[NotStaged]:
    """Not-staged calls only the event log knows of: a claimed call with neither a record nor
    a ledger entry (``lost_in_crash``: the proxy stopped while it was in flight, or its record
    was removed), and a ledger entry the event log holds but the ledger lost (a deleted row must
    not un-poison its rollout). A store without event logs adds nothing."""
    found: list[NotStaged] = []
    logged = set(listed)
    for event in facts.events:
        if event.kind == "ledger" and event.call_id is not None and event.call_id not in logged:
            logged.add(event.call_id)
            found.append(
                NotStaged(
                    event.seq if event.seq is not None else -1,
                    event.call_id,
                    str(event.body.get("status", "")),
                    str(event.body.get("reason", "")),
                )
            )
    for seq, call_id in facts.claims.items():
        if call_id not in staged and call_id not in logged:
            found.append(NotStaged(seq, call_id, LOST_IN_CRASH, LOST_IN_CRASH))
    return found


class RolloutExcluded(CaptureProxyError):
    """A rollout named in a trainer-facing read is open or poisoned, and the read did not ask
    for such rollouts (``include_open=True`` / ``include_poisoned=True``, named in the message
    and in `keyword`)."""

    def __init__(self, rollout_id: str, message: str, keyword: str) -> None:
        super().__init__(message)
        self.rollout_id = rollout_id
        self.keyword = keyword


def check_included(
    rollout_id: str, status: RolloutStatus, *, include_open: bool, include_poisoned: bool
) -> None:
    """Raise `RolloutExcluded` when the filters leave the rollout out."""
    if status.poisoned and not include_poisoned:
        bad = [e for e in status.not_staged if e.poisons]
        what = ", ".join(f"{e.call_id} (seq {e.seq}) {e.status}: {e.reason}" for e in bad[:3])
        raise RolloutExcluded(
            rollout_id,
            f"rollout {rollout_id!r} is poisoned (answered but not staged: "
            f"{what or 'flagged in its header'}): pass include_poisoned=True to read it anyway",
            "include_poisoned",
        )
    if status.state is not RolloutState.SEALED and not include_open:
        raise RolloutExcluded(
            rollout_id,
            f"rollout {rollout_id!r} is open (not sealed: calls may still be added): pass "
            "include_open=True to read it anyway, or seal it first (the control API, or "
            "`capture-proxy seal STORE ROLLOUT` offline)",
            "include_open",
        )
