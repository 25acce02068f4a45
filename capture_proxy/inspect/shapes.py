"""The shape of every `inspect` view, as TypedDicts.

`capture_proxy.inspect.views` builds these and `capture_proxy.inspect.render` draws them, so mypy
checks the one against the other: a key renamed or dropped in a builder fails type checking in the
renderer. They are plain dicts at run time, which is what ``inspect --json`` prints, key for key in
the order declared here (docs/inspect.md documents them).

A row of the rollout view is a `StagedEntry` or a `FailureEntry`; their ``status`` tells which
(``"staged"`` or one of the ledger's statuses), and is how the renderer narrows the union.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypeAlias, TypedDict

__all__ = [
    "AttachmentEntry",
    "CallEntry",
    "CallView",
    "CheckedAttachmentEntry",
    "DigestCheck",
    "FailureEntry",
    "FailureStatus",
    "OutcomeEntry",
    "OverviewView",
    "PromptDrift",
    "ReplicaEntry",
    "RolloutDetail",
    "RolloutSummary",
    "RolloutView",
    "StagedCallDetail",
    "StagedEntry",
    "StoredCoords",
    "TokensDetail",
    "ToolCallPreview",
    "TrajectoryBreak",
    "TrajectoryDrift",
    "TrajectoryNotStaged",
    "TrajectorySegment",
    "TrajectorySummary",
    "TrajectoryUnavailable",
    "VerifyProblem",
    "VerifyView",
]

#: The statuses of a call that was not staged (`CallStatus` without ``staged``).
FailureStatus: TypeAlias = Literal[
    "capture_failed", "rejected", "upstream_error", "aborted", "lost_in_crash"
]


class AttachmentEntry(TypedDict):
    sha256: str
    media_type: str
    size: int


class CheckedAttachmentEntry(AttachmentEntry):
    #: The attachment's bytes still hash to its sha256.
    ok: bool


class PromptDrift(TypedDict):
    """Where a call's prompt stops extending its parent's prompt + completion."""

    position: int
    parent_len: int
    prompt_len: int


class ToolCallPreview(TypedDict):
    name: str | None
    arguments: str


class StagedEntry(TypedDict):
    """A staged call as one row of the rollout view (and one ``--follow`` event)."""

    rollout_id: str
    seq: int
    call_id: str
    status: Literal["staged"]
    orphaned: bool
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    parent_call_id: str | None
    retry_of: str | None
    drift: PromptDrift | None
    weight_version: int
    created_at_ms: int
    reasoning: str
    content: str
    tool_calls: list[ToolCallPreview]
    attachments: list[AttachmentEntry]


class FailureEntry(TypedDict):
    """A call that was not staged: what happened and why (a row, an event, or a call view)."""

    rollout_id: str
    seq: int
    call_id: str
    status: FailureStatus
    reason: str
    http_status: int | None
    message: str
    at_ms: int


CallEntry: TypeAlias = StagedEntry | FailureEntry


class RolloutSummary(TypedDict):
    """One rollout's counts, tokens and time span (a row of the overview)."""

    rollout_id: str
    state: str
    poisoned: bool
    calls: int
    statuses: dict[str, int]
    orphaned: int
    prompt_tokens: int
    completion_tokens: int
    created_at_ms: int
    sealed_at_ms: int | None
    first_at_ms: int | None
    last_at_ms: int | None


class OutcomeEntry(TypedDict):
    """The driver's latest outcome of a rollout (`RolloutOutcome.to_dict`)."""

    reward: float | dict[str, float] | None
    group_id: str | None
    metadata: dict[str, Any] | None
    at_ms: int


class PlainDivergence(TypedDict):
    """A token-in call whose plain rendering would have differed from the tokens it sent."""

    seq: int
    call_id: str
    #: The first prompt position where they differ.
    position: int


class TokenInSummary(TypedDict):
    """What token-in did in one rollout (present only for a rollout that chose token-in for
    itself or has token-in calls)."""

    #: The rollout's own choice (its ``token_in`` event); None: the proxy's setting decided.
    choice: bool | None
    #: Staged token-in calls, and those of them that say how the plain rendering compared.
    calls: int
    measured: int
    #: The calls whose plain rendering would have diverged, and where (what token-in avoided).
    diverged: list[PlainDivergence]
    #: The token-in calls that started a new segment: ``{seq, call_id, reason, detail}``.
    new_segments: list[dict[str, Any]]


class RolloutDetail(RolloutSummary):
    metadata: dict[str, Any]
    outcome: OutcomeEntry | None
    outcomes: int
    token_in: NotRequired[TokenInSummary]


class ReplicaEntry(TypedDict):
    """An upstream replica of the running proxy `inspect` reads (docs/fleets.md)."""

    replica: str
    state: str
    #: Why it is not healthy; "" when it is.
    problem: str
    #: Rollouts in the proxy's memory pinned to it.
    live_rollouts: int
    version: str
    fingerprint: str
    model: str
    probed_at_ms: int


class OverviewView(TypedDict):
    view: Literal["rollouts"]
    store: str
    rollouts: list[RolloutSummary]
    #: Only when the store is a running proxy's (empty with a single upstream).
    replicas: NotRequired[list[ReplicaEntry]]


class TrajectorySegment(TypedDict):
    start: int
    end: int
    call_ids: list[str]


class TrajectoryDrift(TypedDict):
    call_id: str
    parent_call_id: str
    position: int
    parent_len: int
    prompt_len: int


class TrajectoryBreak(TypedDict):
    """Where a new segment began (token `position`), opened by `call_id`, and why."""

    call_id: str
    position: int
    reason: str


class TrajectoryNotStaged(TypedDict):
    seq: int
    call_id: str
    status: str
    reason: str


class TrajectorySummary(TypedDict):
    ok: Literal[True]
    #: The trajectory's own flags, as a trainer reads them (`Trajectory.state`, ...).
    state: str
    poisoned: bool
    n_failures: int
    not_staged: list[TrajectoryNotStaged]
    tokens: int
    trained_tokens: int
    segments: list[TrajectorySegment]
    breaks: list[TrajectoryBreak]
    drift: list[TrajectoryDrift]
    apart: list[str]
    retries_skipped: list[str]


class TrajectoryUnavailable(TypedDict):
    ok: Literal[False]
    note: str


class RolloutView(TypedDict):
    view: Literal["rollout"]
    store: str
    rollout: RolloutDetail
    calls: list[CallEntry]
    last: CallEntry | None
    trajectory: TrajectorySummary | TrajectoryUnavailable


class StoredCoords(TypedDict):
    prev_len: int
    delta_len: int
    cum_len: int


class DigestCheck(TypedDict):
    ok: bool
    problem: str | None


class TokensDetail(TypedDict):
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    #: With ``--tokenizer``: the text of each token.
    prompt_text: NotRequired[list[str]]
    completion_text: NotRequired[list[str]]


class StagedCallDetail(TypedDict):
    """One staged call in full."""

    rollout_id: str
    seq: int
    call_id: str
    status: Literal["staged"]
    orphaned: bool
    parent_call_id: str | None
    retry_of: str | None
    created_at_ms: int
    weight_version: int
    model: str
    upstream_version: str
    tokenizer_fingerprint: str
    schema_version: int
    finish_reason: str
    sampling: dict[str, Any]
    request: dict[str, Any]
    response: dict[str, Any]
    extras: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    stored: StoredCoords
    digest: str
    extras_digest: str
    check: DigestCheck
    attachments: list[CheckedAttachmentEntry]
    #: With ``--tokens``.
    tokens: NotRequired[TokensDetail]
    # Fields of record schema 2, each present only when set (not at its "unknown" default), so
    # records from before them show as they always did.
    engine_weight_version: NotRequired[str]
    #: ``[version, start, end]`` over completion positions.
    weight_spans: NotRequired[list[list[Any]]]
    token_in: NotRequired[bool]
    #: ``[start, end, reason]`` over prompt positions.
    bridge_spans: NotRequired[list[list[Any]]]
    #: A token-in call: where its plain rendering would have diverged (null: nowhere), when
    #: measured; and the new segment it started, ``{reason, detail}``, when it did.
    plain_divergence: NotRequired[int | None]
    token_in_break: NotRequired[dict[str, str]]
    replica: NotRequired[str]
    effective_sampling: NotRequired[dict[str, Any]]
    logprobs_mode: NotRequired[str]


class CallView(TypedDict):
    view: Literal["call"]
    store: str
    call: StagedCallDetail | FailureEntry


class VerifyProblem(TypedDict):
    key: str
    message: str


class VerifyView(TypedDict):
    view: Literal["verify"]
    store: str
    ok: bool
    checked: int
    problems: list[VerifyProblem]
