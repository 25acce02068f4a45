"""Trajectories: a rollout's calls linearized into one token sequence a trainer learns from.

    >>> traj = open_store("parquet:///runs/capture").trajectory("rollout-17")
    >>> traj.token_ids, traj.loss_mask, traj.logprobs      # int32 ids, 0/1 mask, float32
    >>> traj.segments                                      # where drift forced a new sequence
    >>> traj.drift                                         # which call drifted, where, by how much
    >>> traj.breaks                                        # every segment break, with its reason
    >>> traj.poisoned, traj.state, traj.not_staged         # what the store could not capture

The walk (docs/trajectories.md has a worked example): take the rollout's staged calls in
sequence order, keep only the latest attempt of each retried call, and keep calls without tools
(OpenCode's title call) apart when the rollout has calls with tools. The first call opens a
segment with its prompt (mask 0) and completion (mask 1). Each later call either *extends* the
running sequence (the previous call's prompt + completion is a prefix of its prompt): its new
prompt tokens are appended with mask 0 and its completion with mask 1; or it has *drifted* (the
chat template re-rendered history differently, the agent edited its context, tool arguments
were re-serialized): the drift is reported and the call opens a new segment with its whole
prompt (mask 0). Nothing is spliced: every segment is a sequence the model actually saw.
A call that follows an answered-but-not-staged call (`capture_proxy.read.status`), or a call whose
stream ended early after some tokens (``upstream_error``, ``aborted``: the client may replay the
partial answer), also opens a new segment (a ``not_staged`` break) unless it is that call's retry:
its prompt may hold what the policy generated in that call, which must not read as prompt tokens
of a sequence the policy generated.

Token-in calls (`StagedCallRecord.token_in`) extend the sequence by construction; one that did
not (the proxy sent the plain rendering) says why in its extras
(`capture_proxy.schemas.token_in_extras`), and its break carries that reason instead of
``drift``. The prompt tokens the proxy inserted (`StagedCallRecord.bridge_spans`) are prompt
tokens like any other (mask 0) and are listed in `Trajectory.bridge_spans`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from ..schemas.records import RolloutState, StagedCallRecord
from ..schemas.token_in_extras import SegmentBreak, segment_break_of
from ..schemas.tokens import common_prefix_len, full_sequence
from ..sinks.base import StagingSource
from .status import UNKNOWN, NotStaged, RolloutStatus, rollout_status

__all__ = [
    "Break",
    "Drift",
    "NotStaged",
    "ReplicaMoved",
    "Segment",
    "SegmentBreak",
    "Trajectory",
    "build_trajectory",
    "has_tools",
    "trajectory_from_records",
]


@dataclass(frozen=True, slots=True)
class Segment:
    """Tokens ``[start, end)`` of the trajectory: one sequence, built by `call_ids` in order."""

    start: int
    end: int
    call_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Drift:
    """A call whose prompt does not extend the sequence before it.

    `parent_call_id` is the call before it in the trajectory, whose prompt + completion
    (`parent_len` tokens) the call's prompt (`prompt_len` tokens) should have started with;
    `position` is the first token where they differ (their common prefix length).
    """

    call_id: str
    parent_call_id: str
    position: int
    parent_len: int
    prompt_len: int


@dataclass(frozen=True, slots=True)
class ReplicaMoved:
    """The rollout moved to another upstream replica between two staged calls (its replica went
    away, with ``--on-replica-loss move``): the call's prompt was prefilled afresh on
    `to_replica`, with none of `from_replica`'s cache."""

    from_replica: str
    to_replica: str


@dataclass(frozen=True, slots=True)
class Break:
    """Where and why a new segment began: the one list of segment breaks of a `Trajectory`.

    `position` is the index in `Trajectory.token_ids` where the new segment starts, opened by
    call `call_id`. `reason` says why: ``"drift"`` (the call's prompt did not extend the running
    sequence; `detail` is its `Drift`) or ``"not_staged"`` (a call before it that answered, in
    full or in part (a broken or aborted stream), was not staged, so its prompt may hold tokens
    the policy generated that the store has no record of; `detail` is that call's
    `NotStaged`), or ``"replica_moved"`` (the call went to another upstream replica than the
    call before it; `detail` is a `ReplicaMoved` naming both). A
    token-in call that could not extend the sequence gives its own reason (``history_edited``,
    ``tools_changed``, ``template_changed``, ...; `detail` is its `SegmentBreak`). A trainer
    should treat an unknown reason as a break like any other.
    """

    call_id: str
    position: int
    reason: str
    detail: Drift | NotStaged | SegmentBreak | ReplicaMoved | None = None


@dataclass(slots=True)
class Trajectory:
    """One rollout as training data; every per-token array has ``len(token_ids)`` entries."""

    rollout_id: str
    #: ``open`` or ``sealed`` (`RolloutState`): an open rollout may still get calls.
    state: RolloutState = RolloutState.OPEN
    #: A call was answered but not staged (`not_staged` entries whose `poisons` is true): the
    #: store misses tokens the policy generated in this rollout.
    poisoned: bool = False
    #: Calls of the rollout that were not staged, in sequence order, poisoning or not.
    not_staged: list[NotStaged] = field(default_factory=list)
    #: The rollout's reward, from the driver's latest outcome (``PUT .../outcome``) when it is
    #: one number; None when it is an object (then see `reward_components`) or none was sent.
    reward: float | None = None
    #: The reward's parts, when the driver reported the reward as an object of numbers.
    reward_components: dict[str, float] | None = None
    #: The rollout's group as the driver reported it (GRPO: the rollouts of one prompt).
    group_id: str | None = None
    #: The linearized token ids (int32): segment after segment.
    token_ids: array[int] = field(default_factory=lambda: array("i"))
    #: 1 on tokens the policy generated (train on them), 0 on prompt tokens.
    loss_mask: array[int] = field(default_factory=lambda: array("b"))
    #: The generating logprob of each generated token (float32); 0.0 on prompt tokens.
    logprobs: array[float] = field(default_factory=lambda: array("f"))
    #: Per token: the index in `calls` of the call that added it.
    call_index: array[int] = field(default_factory=lambda: array("i"))
    #: Per token: the weight version of the call that first produced it (0 for prompt text).
    weight_versions: array[int] = field(default_factory=lambda: array("q"))
    #: Per token: the engine's own weight version that sampled it, from the record's
    #: `weight_spans` (carried like `weight_versions`); None where unknown and on prompt text.
    engine_weight_versions: list[str | None] = field(default_factory=list)
    #: Tokens the proxy inserted into token-in prompts (the records' `bridge_spans`), as
    #: ``(start, end, reason)`` over `token_ids`; their loss mask is 0.
    bridge_spans: list[tuple[int, int, str]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    #: Every segment break, in order, with its reason (`Break`).
    breaks: list[Break] = field(default_factory=list)
    #: The breaks whose reason is drift, as `Drift` (each is the `detail` of its `Break`).
    drift: list[Drift] = field(default_factory=list)
    #: The call ids in the trajectory, in order.
    calls: list[str] = field(default_factory=list)
    #: Calls kept apart (no tools: e.g. OpenCode's title call); see `include_untooled`.
    apart: list[str] = field(default_factory=list)
    #: Earlier attempts of retried calls (the latest attempt is in the trajectory).
    retries_skipped: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def n_failures(self) -> int:
        """How many calls of the rollout were not staged (``len(not_staged)``)."""
        return len(self.not_staged)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and dicts (JSON-ready)."""
        return {
            "rollout_id": self.rollout_id,
            "state": str(self.state),
            "poisoned": self.poisoned,
            "n_failures": self.n_failures,
            "not_staged": [_not_staged_dict(n) for n in self.not_staged],
            "reward": self.reward,
            "reward_components": (
                None if self.reward_components is None else dict(self.reward_components)
            ),
            "group_id": self.group_id,
            "token_ids": self.token_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "call_index": self.call_index.tolist(),
            "weight_versions": self.weight_versions.tolist(),
            "engine_weight_versions": list(self.engine_weight_versions),
            "bridge_spans": [list(span) for span in self.bridge_spans],
            "segments": [
                {"start": s.start, "end": s.end, "call_ids": list(s.call_ids)}
                for s in self.segments
            ],
            "breaks": [
                {
                    "call_id": b.call_id,
                    "position": b.position,
                    "reason": b.reason,
                    "detail": _detail_dict(b.detail),
                }
                for b in self.breaks
            ],
            "drift": [_drift_dict(d) for d in self.drift],
            "calls": list(self.calls),
            "apart": list(self.apart),
            "retries_skipped": list(self.retries_skipped),
        }


def _detail_dict(
    detail: Drift | NotStaged | SegmentBreak | ReplicaMoved | None,
) -> dict[str, Any] | None:
    if isinstance(detail, Drift):
        return _drift_dict(detail)
    if isinstance(detail, SegmentBreak):
        return detail.to_dict()
    if isinstance(detail, ReplicaMoved):
        return {"from_replica": detail.from_replica, "to_replica": detail.to_replica}
    return None if detail is None else _not_staged_dict(detail)


def _not_staged_dict(n: NotStaged) -> dict[str, Any]:
    return {"seq": n.seq, "call_id": n.call_id, "status": n.status, "reason": n.reason}


def _drift_dict(d: Drift) -> dict[str, Any]:
    return {
        "call_id": d.call_id,
        "parent_call_id": d.parent_call_id,
        "position": d.position,
        "parent_len": d.parent_len,
        "prompt_len": d.prompt_len,
    }


def _engine_versions(record: StagedCallRecord) -> list[str | None]:
    """Per completion token, the engine weight version of the span covering it (else None)."""
    out: list[str | None] = [None] * len(record.completion_token_ids)
    for version, start, end in record.weight_spans:
        out[start:end] = [version] * (end - start)
    return out


def has_tools(record: StagedCallRecord) -> bool:
    """True when the call offered the model tools (OpenCode's agent calls; not its title call)."""
    tools = record.request.get("tools")
    return isinstance(tools, list) and len(tools) > 0


def _latest_attempts(
    records: list[StagedCallRecord],
) -> tuple[list[StagedCallRecord], list[str]]:
    """Keep the latest attempt of each retried call; also return the skipped attempts' ids."""
    root: dict[str, str] = {}
    for r in records:  # in seq order, so a retry's target was seen before it (if staged)
        root[r.call_id] = root.get(r.retry_of, r.retry_of) if r.retry_of else r.call_id
    latest: dict[str, StagedCallRecord] = {}
    for r in records:
        latest[root[r.call_id]] = r
    kept = [r for r in records if latest[root[r.call_id]] is r]
    skipped = [r.call_id for r in records if latest[root[r.call_id]] is not r]
    return kept, skipped


def build_trajectory(
    source: StagingSource, rollout_id: str, *, include_untooled: bool = False
) -> Trajectory:
    """Linearize a rollout's staged calls (see the module docs). KeyError for an unknown rollout.

    `include_untooled` walks calls without tools like the others instead of listing them in
    `Trajectory.apart`. Orphaned records (staged after their caller gave up) are not used.
    The records are not verified here: `Store.trajectory` verifies them by default.
    """
    status = rollout_status(source, rollout_id)
    return trajectory_from_records(
        rollout_id, source.calls(rollout_id), include_untooled=include_untooled, status=status
    )


def trajectory_from_records(
    rollout_id: str,
    records: list[StagedCallRecord],
    *,
    include_untooled: bool = False,
    status: RolloutStatus = UNKNOWN,
) -> Trajectory:
    """`build_trajectory` over records already read (the rollout's, in sequence order).

    `status` is the rollout's state, not-staged calls and outcome (`rollout_status`); without
    it the trajectory is marked open, with no call known to be missing and no reward.
    """
    kept, skipped = _latest_attempts(records)
    outcome = status.outcome
    traj = Trajectory(
        rollout_id,
        state=status.state,
        poisoned=status.poisoned,
        not_staged=list(status.not_staged),
        retries_skipped=skipped,
        reward=None if outcome is None else outcome.scalar_reward,
        reward_components=None if outcome is None else outcome.reward_components,
        group_id=None if outcome is None else outcome.group_id,
    )
    # Keep untooled calls apart only when there is a tooled main line to keep them apart from.
    if not include_untooled and any(map(has_tools, kept)):
        traj.apart = [r.call_id for r in kept if not has_tools(r)]
        kept = [r for r in kept if has_tools(r)]
    _linearize(traj, kept)
    return traj


def _zeros(kind: str, n: int) -> array[Any]:
    return array(kind, bytes(array(kind).itemsize * n))


def _linearize(traj: Trajectory, records: list[StagedCallRecord]) -> None:
    tokens, mask, lps = traj.token_ids, traj.loss_mask, traj.logprobs
    index, versions = traj.call_index, traj.weight_versions
    engine = traj.engine_weight_versions
    seg_start = 0
    seg_calls: list[str] = []
    # Within a segment the tokens so far are exactly the previous call's prompt + completion,
    # so "extends the running sequence" is a prefix test against tokens[seg_start:].
    running = array("i")
    prev: StagedCallRecord | None = None
    answered_lost = [n for n in traj.not_staged if n.may_have_answered]
    for i, r in enumerate(records):
        prompt, completion = r.prompt_token_ids, r.completion_token_ids
        shared = common_prefix_len(running, prompt) if prev is not None else 0
        # The last not-staged call between this call and the one before it that may have
        # answered (in full, or a stream that broke after some tokens): its answer is likely in
        # this prompt's new tokens, and nothing says which ones. A retry of that call (the same
        # request again) holds none of it.
        lost = (
            next(
                (
                    n
                    for n in reversed(answered_lost)
                    if prev.seq < n.seq < r.seq and r.retry_of != n.call_id
                ),
                None,
            )
            if prev is not None and len(prompt) > len(running)
            else None
        )
        moved = (
            ReplicaMoved(prev.replica, r.replica)
            if prev is not None and prev.replica and r.replica and prev.replica != r.replica
            else None
        )
        if prev is not None and shared == len(running) and lost is None and moved is None:
            new_prompt = prompt[shared:]
            new_versions: array[int] = _zeros("q", len(new_prompt))
            new_engine: list[str | None] = [None] * len(new_prompt)
        else:
            said = segment_break_of(r.extras) if r.token_in else None
            if prev is not None and shared < len(running) and said is not None:
                # A token-in call that sent the plain rendering says why.
                traj.breaks.append(Break(r.call_id, len(tokens), said.reason, said))
            elif prev is not None and shared < len(running):
                # Drift first: the drifted call re-states its whole prompt either way, and the
                # not-staged call stays listed in `not_staged`.
                drift = Drift(r.call_id, prev.call_id, shared, len(running), len(prompt))
                traj.drift.append(drift)
                traj.breaks.append(Break(r.call_id, len(tokens), "drift", drift))
            elif prev is not None and lost is not None:
                traj.breaks.append(Break(r.call_id, len(tokens), "not_staged", lost))
            elif prev is not None:
                traj.breaks.append(Break(r.call_id, len(tokens), "replica_moved", moved))
            if prev is not None:
                traj.segments.append(Segment(seg_start, len(tokens), tuple(seg_calls)))
            # A new segment re-states the whole prompt. Its shared prefix was produced by
            # earlier calls: those tokens keep their weight versions; the rest are 0 (None).
            new_prompt = prompt
            new_versions = versions[seg_start : seg_start + shared]
            new_versions.extend(_zeros("q", len(prompt) - shared))
            new_engine = engine[seg_start : seg_start + shared]
            new_engine.extend([None] * (len(prompt) - shared))
            seg_start, seg_calls = len(tokens), []
        n_new, n_out = len(new_prompt), len(completion)
        skipped = len(prompt) - n_new  # prompt tokens already in the sequence
        for start, end, why in r.bridge_spans:
            if end > skipped:
                base = len(tokens) - skipped
                traj.bridge_spans.append((base + max(start, skipped), base + end, why))
        tokens.extend(new_prompt)
        tokens.extend(completion)
        mask.extend(_zeros("b", n_new))
        mask.extend(array("b", [1]) * n_out)
        lps.extend(_zeros("f", n_new))
        lps.extend(r.completion_logprobs)
        index.extend(array("i", [i]) * (n_new + n_out))
        versions.extend(new_versions)
        versions.extend(array("q", [r.weight_version]) * n_out)
        engine.extend(new_engine)
        engine.extend(_engine_versions(r))
        traj.calls.append(r.call_id)
        seg_calls.append(r.call_id)
        running = full_sequence(prompt, completion)
        prev = r
    if seg_calls:
        traj.segments.append(Segment(seg_start, len(tokens), tuple(seg_calls)))
