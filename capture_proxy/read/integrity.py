"""What "verified" means for a rollout: the one check every trainer-facing read makes.

`Store.verify`, ``inspect --verify``, `Store.calls` / `Store.trajectory` / `iter_trajectories`
with ``verify=True`` (the default) and `export_store` all call `rollout_problems`. A rollout
verifies when all of these hold (docs/contract.md, "What verified means"):

* every record's digest matches its content (`schemas.digest.verify_record`);
* its event log's hash chain holds (`schemas.events.check_chain`): no event deleted or edited
  in the middle of it;
* the accounting holds: every ``staged`` event's record is there with that digest and seq,
  every staged record is named by a ``staged`` event, every ``ledger`` event's ledger entry is
  there and every ledger entry is named by one; no seq is held by two calls;
* the header says what the chain says: sealed exactly when the chain has a ``seal`` event, its
  latest outcome (reward, group, time) is the chain's latest ``outcome`` event, and it is not
  "not poisoned" while the chain holds a call answered but not staged;
* when the reader was given the rollout's expected chain head (`chain_head`, from the seal or
  outcome answer a driver kept), the stored chain ends there.

Rollouts written before event logs (records of schema 1, in stores migrated from before them)
have no chain: their records are held to their digests only. A rollout with a record of
schema 2 and no event log is not one of them: its log was removed.

A rollout that fails is never served as clean: by name it raises `RolloutUnverified` (a
`RolloutExcluded`, keyword ``verify``), and the iterating reads and the export leave it out
and say so (``skipped["unverified"]``, `ExportSummary.left_out`). ``verify=False`` reads it
anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CaptureProxyError
from ..schemas.digest import DigestMismatch, MessageDigestCache, RequestValueCache, verify_record
from ..schemas.events import EventKind, RolloutEvent, chain_head, check_chain
from ..schemas.records import RolloutState, StagedCallRecord
from ..schemas.store_head import StoreHead, StoreHeadState
from ..sinks.base import ClaimFiles, Progress, StagingSource
from .status import POISONING, RolloutExcluded, RolloutFacts, read_header

__all__ = [
    "VERIFY_KEYWORD",
    "Problem",
    "RolloutUnverified",
    "StoreCorrupted",
    "chain_head",
    "rollout_problems",
    "store_head_of",
    "store_head_problems",
    "store_problems",
]

#: The keyword (and `RolloutExcluded.keyword`) that reads a rollout that does not verify.
VERIFY_KEYWORD = "verify"


class RolloutUnverified(RolloutExcluded):
    """A rollout named in a trainer-facing read does not verify (`rollout_problems`);
    `problems` lists what is wrong. ``verify=False`` reads it anyway."""

    def __init__(self, rollout_id: str, problems: Sequence[str]) -> None:
        shown = "; ".join(problems[:3])
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        super().__init__(
            rollout_id,
            f"rollout {rollout_id!r} does not verify ({shown}{more}): pass verify=False to "
            "read it anyway",
            VERIFY_KEYWORD,
        )
        self.problems = tuple(problems)


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing `verify` found wrong: which key (attachment, rollout) and what."""

    key: str
    message: str


class StoreCorrupted(CaptureProxyError):
    """`Store.verify` found problems; `.problems` lists every one of them."""

    def __init__(self, problems: list[Problem]) -> None:
        lines = "\n".join(f"  {p.key}: {p.message}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{len(problems)} problem(s) in the store:\n{lines}{more}")
        self.problems = problems


def store_problems(
    source: StagingSource,
    digester: MessageDigestCache,
    encoder: RequestValueCache,
    progress: Progress | None = None,
    expected_store_head: StoreHead | None = None,
) -> list[Problem]:
    """Every problem in the store (`Store.problems`, ``inspect --verify``): each record read
    and its digest checked once, attachments no record refers to, then each rollout held to
    `rollout_problems` with what the record pass told (its digest, its schema), and, given the
    store head an operator kept (`expected_store_head`), the store's head against it."""
    found: list[Problem] = []
    heads: list[tuple[str, str, int]] = []
    keys = list(source.all_keys())
    seen: dict[str, list[StagedCallRecord]] = {}
    for done, key in enumerate(keys, 1):
        if progress is not None:
            progress(done - 1, len(keys) + 1)
        try:
            (record,) = source.fetch([key])
            verify_record(record, digester=digester, encoder=encoder)
        except DigestMismatch as e:
            found.append(Problem(key, str(e)))
        except Exception as e:  # a torn or undecodable row is a problem to report, not a crash
            found.append(Problem(key, f"unreadable: {type(e).__name__}: {e}"))
        else:
            seen.setdefault(record.rollout_id, []).append(record)
    for sha in source.unreferenced_attachments():
        found.append(Problem(f"attachment:{sha}", "attachment without a record"))
    for rollout_id in source.rollouts():
        key = f"rollout:{rollout_id}"
        try:
            facts = RolloutFacts.read(
                source, rollout_id, read_header(source, rollout_id), claims=False
            )
        except Exception as e:  # a header or ledger row no writer could have written
            found.append(Problem(key, f"unreadable: {type(e).__name__}: {e}"))
            continue
        if facts.events:
            last = facts.events[-1]
            heads.append((rollout_id, last.hash, last.position))
        problems = rollout_problems(
            facts,
            seen.get(rollout_id, []),
            lambda keys: [c.digest for c in source.coords(keys)],
            check_digests=False,
        )
        found.extend(Problem(key, message) for message in problems)
    if expected_store_head is not None:
        try:
            actual = store_head_of(source, heads)
        except Exception as e:  # a crafted store: an event whose hash or position is no value
            found.append(Problem("store", f"its store head cannot be computed: {e}"))
        else:
            found.extend(
                Problem("store", m) for m in store_head_problems(actual, expected_store_head)
            )
    if progress is not None:
        progress(len(keys) + 1, len(keys) + 1)
    return found


def store_head_of(source: StagingSource, heads: Iterable[tuple[str, str, int]]) -> StoreHead:
    """The store head over `heads` (each rollout's last event: id, hash, position) and, for a
    store whose claims are files (`ClaimFiles`: a Parquet dataset), its claim files."""
    claims = source.claim_counts() if isinstance(source, ClaimFiles) else None
    return StoreHeadState.of(heads, claims).head()


def store_head_problems(actual: StoreHead, kept: StoreHead) -> list[str]:
    """What differs between the store head recomputed from a store (`actual`) and the one its
    writer published and an operator kept ([] when they agree). The head is one hash: it says
    *that* the set of rollouts differs; the counts say how (a rollout deleted, one truncated,
    one rewritten in place); the per-rollout checks and anchored reads say which."""
    if actual.head == kept.head:
        return []
    said = f"the store head is {actual.token()}, not the {kept.token()} its writer published"
    if kept.rollouts < 0:  # only the hash was kept
        return [f"{said}: rollouts were deleted, added or rewritten since"]
    fewer, more = kept.rollouts - actual.rollouts, kept.events - actual.events
    if fewer > 0:
        how = f"{fewer} rollout(s) the kept head covers are gone (deleted)"
    elif fewer < 0:
        how = (
            f"{-fewer} rollout(s) more than the kept head covers: written after it was "
            "published (check against the writer's latest head) or put there"
        )
    elif kept.events >= 0 and more > 0:
        how = f"as many rollouts, {more} event(s) fewer: a rollout was cut short (truncated)"
    elif kept.events >= 0 and more < 0:
        how = (
            f"as many rollouts, {-more} event(s) more: written after the head was published "
            "(check against the writer's latest head) or put there"
        )
    elif kept.events >= 0 and kept.claims >= 0 and actual.claims < kept.claims:
        how = (
            f"as many rollouts and events, {kept.claims - actual.claims} claim file(s) fewer: "
            "a claim file was deleted (after a crash the only trace of a call in flight; "
            "without it the call's rollout reads as not poisoned)"
        )
    elif kept.events >= 0 and kept.claims >= 0 and actual.claims > kept.claims:
        how = (
            f"as many rollouts and events, {actual.claims - kept.claims} claim file(s) more: "
            "claimed after the head was published (check against the writer's latest head) "
            "or put there"
        )
    else:
        how = "as many rollouts and events: a rollout was rewritten or replaced by another"
    return [f"{said}: {how}"]


def rollout_problems(
    facts: RolloutFacts,
    records: Sequence[StagedCallRecord],
    coords: Callable[[list[str]], Iterable[str]],
    *,
    check_digests: bool = True,
    expected_head: str | None = None,
    digester: MessageDigestCache | None = None,
    encoder: RequestValueCache | None = None,
) -> list[str]:
    """Everything wrong with one rollout ([] when it verifies; see the module docs).

    `records` are the rollout's records as read (orphaned ones may be left out); their digests
    are recomputed unless ``check_digests=False`` (a caller that checked them already).
    `coords` gives the stored digests of the staged calls `records` leaves out, in order.
    `expected_head` is the driver's anchor (`chain_head`), or None.
    """
    try:
        return _problems(facts, records, coords, check_digests, expected_head, digester, encoder)
    except Exception as e:  # a crafted store: wrong types where the check reads; never a crash
        return [f"unreadable: {type(e).__name__}: {e}"]


def _problems(
    facts: RolloutFacts,
    records: Sequence[StagedCallRecord],
    coords: Callable[[list[str]], Iterable[str]],
    check_digests: bool,
    expected_head: str | None,
    digester: MessageDigestCache | None,
    encoder: RequestValueCache | None,
) -> list[str]:
    found: list[str] = []
    schema: dict[str, int] = {}
    digester = digester if digester is not None else MessageDigestCache()
    for record in records:
        schema[record.call_id] = record.schema_version
        if check_digests:
            try:
                verify_record(record, digester=digester, encoder=encoder)
            except Exception as e:  # DigestMismatch, or a record no writer could have sealed
                found.append(str(e))
    events = facts.events
    anchored = expected_head is not None
    if anchored and chain_head(events) != expected_head:
        found.append(
            f"its chain head is {chain_head(events) or 'absent (no event log)'}, not the "
            f"{expected_head} its driver kept"
        )
    # Whether the rollout must have an event log, and from when: one that has events, or a
    # record of schema 2 (written by a proxy that keeps event logs), or an anchor. Records and
    # ledger entries from before its first event are a migrated store's: not accounted for.
    keeps_log = anchored or bool(events) or any(v >= 2 for v in schema.values())
    since = events[0].at_ms if events and not anchored else None
    for br in check_chain(events):
        found.append(f"event log broken at position {br.position}: {br.message}")
    found.extend(_staged_accounting(facts, records, coords, schema, keeps_log, since))
    found.extend(_ledger_accounting(facts, keeps_log, since))
    found.extend(_duplicate_seqs(facts))
    if keeps_log:
        found.extend(_header(facts, since))
    return found


def _where(e: RolloutEvent) -> str:
    return f"seq {e.seq} (call {e.call_id}, event {e.position})"


def _staged_accounting(
    facts: RolloutFacts,
    records: Sequence[StagedCallRecord],
    coords: Callable[[list[str]], Iterable[str]],
    schema: Mapping[str, int],
    keeps_log: bool,
    since: int | None,
) -> list[str]:
    found: list[str] = []
    # Every staged call the store shows, by the summaries and by the records read (a crafted
    # store may show a record in one and not the other): its seq and creation time.
    staged = {s.call_id: (s.seq, s.created_at_ms) for s in facts.summaries}
    staged.update((r.call_id, (r.seq, r.created_at_ms)) for r in records)
    digests = {r.call_id: r.digest for r in records}
    missing = [c for c in staged if c not in digests]
    if missing:
        digests.update(zip(missing, coords(missing), strict=True))
    named: set[str] = set()
    for e in facts.events:
        if e.kind != EventKind.STAGED or e.call_id is None:
            continue
        where = _where(e)
        if e.call_id in named:
            found.append(f"{where}: the call is staged twice in the event log")
        named.add(e.call_id)
        held = staged.get(e.call_id)
        if held is None:
            found.append(f"{where} was staged; its record is missing")
        elif digests.get(e.call_id) != e.body.get("digest"):
            found.append(f"{where}: the record's digest is not the one staged")
        elif held[0] != e.seq:
            found.append(f"{where}: its record says seq {held[0]}")
    if not keeps_log:
        return found
    for call_id, (seq, created_at_ms) in staged.items():
        if call_id in named:
            continue
        # A record from before the rollout's first event: staged before the store kept event
        # logs (schema 1, a migrated store). Any other record no event names was put there.
        if since is not None and created_at_ms < since and schema.get(call_id) == 1:
            continue
        found.append(f"seq {seq} (call {call_id}): a staged record no event of the log names")
    return found


def _ledger_accounting(facts: RolloutFacts, keeps_log: bool, since: int | None) -> list[str]:
    found: list[str] = []
    ledger = {(f.call_id, f.status.value, f.reason) for f in facts.failures}
    logged: set[tuple[Any, Any, Any]] = set()
    for e in facts.events:
        if e.kind != EventKind.LEDGER or e.call_id is None:
            continue
        entry = (e.call_id, e.body.get("status"), e.body.get("reason"))
        logged.add(entry)
        if entry not in ledger:
            found.append(
                f"{_where(e)} is in the event log as {entry[1]} ({entry[2]}); its ledger "
                "entry is missing or changed"
            )
    if not keeps_log:
        return found
    for f in facts.failures:
        if (f.call_id, f.status.value, f.reason) in logged:
            continue
        if since is not None and f.at_ms < since:
            continue  # in the ledger before the store kept event logs
        found.append(
            f"seq {f.seq} (call {f.call_id}) is in the ledger as {f.status.value} ({f.reason}); "
            "no event of the log names it"
        )
    return found


def _duplicate_seqs(facts: RolloutFacts) -> list[str]:
    """Sequence numbers held by more than one call (staged or in the ledger). Stores refuse
    them now; a store written before that rule, or by two writers at once, or edited, may hold
    some: the rollout's order and lineage are then ambiguous. A call's own record and ledger
    entry (a write that landed after its caller gave up) are one call."""
    holders: dict[int, set[str]] = {}
    for summary in facts.summaries:
        holders.setdefault(summary.seq, set()).add(summary.call_id)
    for failure in facts.failures:
        holders.setdefault(failure.seq, set()).add(failure.call_id)
    return [
        f"seq {seq} is held by {len(calls)} calls ({', '.join(sorted(calls))})"
        for seq, calls in sorted(holders.items())
        if len(calls) > 1
    ]


def _reward(value: object) -> object:
    return dict(value) if isinstance(value, Mapping) else value


def _header(facts: RolloutFacts, since: int | None) -> list[str]:
    """The header's state, outcome and poisoned flag against the chain."""
    found: list[str] = []
    header = facts.header
    seals = [e for e in facts.events if e.kind == EventKind.SEAL]
    sealed = header is not None and header.state is RolloutState.SEALED
    if sealed and not seals:
        assert header is not None
        # Sealed before the store kept event logs: a migrated rollout whose log holds only what
        # came after (an outcome). A log with calls in it was sealed after them.
        calls = {EventKind.CLAIM, EventKind.STAGED, EventKind.LEDGER}
        before = (
            since is not None
            and (header.sealed_at_ms or 0) < since
            and not any(e.kind in calls for e in facts.events)
        )
        if not before:
            found.append("its header says sealed; its event log has no seal event")
    elif seals and not sealed:
        found.append(f"its event log was sealed (event {seals[0].position}); its header says open")
    outcomes = [e for e in facts.events if e.kind == EventKind.OUTCOME]
    outcome = header.outcome if header is not None else None
    if outcomes:
        last = outcomes[-1]
        said = (_reward(last.body.get("reward")), last.body.get("group_id"), last.at_ms)
        if outcome is None:
            found.append(
                f"its event log has an outcome (event {last.position}); its header has none"
            )
        elif (_reward(outcome.reward), outcome.group_id, outcome.at_ms) != said:
            found.append(
                f"its header's outcome (reward {_reward(outcome.reward)!r}, group "
                f"{outcome.group_id!r}) is not its event log's latest (event {last.position}: "
                f"reward {said[0]!r}, group {said[1]!r})"
            )
    elif outcome is not None and not (since is not None and outcome.at_ms < since):
        found.append("its header has an outcome its event log does not")
    if header is not None and not header.poisoned:
        # A poisoning entry whose ledger row is gone is reported by the ledger's accounting;
        # this is a header that says otherwise than the ledger and the chain both.
        ledger = {(f.call_id, f.status.value) for f in facts.failures}
        lost = [
            e
            for e in facts.events
            if e.kind == EventKind.LEDGER
            and e.body.get("status") in POISONING
            and (e.call_id, e.body.get("status")) in ledger
        ]
        if lost:
            found.append(
                f"its header says not poisoned; its event log has {_where(lost[0])} "
                f"{lost[0].body.get('status')}"
            )
    return found
