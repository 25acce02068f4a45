"""The data behind `capture-proxy inspect`: every view as plain, JSON-ready dicts.

Both outputs come from these dicts: ``--json`` prints them as they are, and
`capture_proxy.inspect.render` draws them as tables, so the two can never disagree. Their shapes
are TypedDicts (`capture_proxy.inspect.shapes`), so mypy holds the renderer to what is built here.
The keys are documented in docs/inspect.md; add a key there (and in `shapes`) when you add one.

Views read through the `Store` API only, so they work the same on SQLite files and Parquet
datasets. A read that fails because the store is damaged becomes an `InspectError` naming the
thing and pointing at ``--verify``, never a traceback.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeAlias, TypedDict, TypeVar, cast

from ..errors import CaptureProxyError, error_text
from ..read.reader import Store
from ..read.status import LOST_IN_CRASH, RolloutStatus
from ..schemas.digest import DigestMismatch, verify_record
from ..schemas.events import token_in_choice
from ..schemas.outcome import RolloutOutcome
from ..schemas.records import (
    LOGPROBS_MODE_UNKNOWN,
    Attachment,
    CallSummary,
    LedgerEntry,
    RolloutInfo,
    StagedCallRecord,
)
from ..schemas.token_in_extras import plain_divergence_of, segment_break_of
from ..schemas.tokens import common_prefix_len, full_sequence
from ..sinks.base import Progress
from ..sinks.remote import RemoteSource
from .shapes import (
    AttachmentEntry,
    CallEntry,
    CallView,
    DigestCheck,
    FailureEntry,
    FailureStatus,
    OutcomeEntry,
    OverviewView,
    PromptDrift,
    ReplicaEntry,
    RolloutDetail,
    RolloutSummary,
    RolloutView,
    StagedCallDetail,
    StagedEntry,
    TokenInSummary,
    TokensDetail,
    ToolCallPreview,
    TrajectorySummary,
    TrajectoryUnavailable,
    VerifyProblem,
    VerifyView,
)

__all__ = [
    "InspectError",
    "call_view",
    "failure_entry",
    "overview",
    "preview",
    "rollout_view",
    "staged_entry",
    "verify_view",
]

#: Characters kept of each previewed text (reasoning, content, tool arguments).
PREVIEW_CHARS = 60

#: Text of one token id, from a tokenizer the user named (``--tokenizer``).
TokenText = Callable[[int], str]


class InspectError(CaptureProxyError):
    """One sentence for the user, naming what was not found or cannot be read (exit status 2)."""


def preview(value: object, limit: int = PREVIEW_CHARS) -> str:
    """One line of at most `limit` characters: newlines shown as ``\\n``, cut with ``...``."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else str(value)
    text = text.replace("\r", "").replace("\n", "\\n").replace("\t", " ").strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def attachment_entry(att: Attachment) -> AttachmentEntry:
    return {"sha256": att.sha256, "media_type": att.media_type, "size": att.size}


def _drift(record: StagedCallRecord, parent_full: array[int] | None) -> PromptDrift | None:
    """Where the call's prompt stops extending its parent's prompt + completion: its drift
    (docs/trajectories.md)."""
    if parent_full is None:
        return None
    shared = common_prefix_len(parent_full, record.prompt_token_ids)
    if shared == len(parent_full):
        return None
    return {
        "position": shared,
        "parent_len": len(parent_full),
        "prompt_len": len(record.prompt_token_ids),
    }


def _tool_calls(message: Mapping[str, Any]) -> list[ToolCallPreview]:
    out: list[ToolCallPreview] = []
    for tc in message.get("tool_calls") or ():
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        if isinstance(fn, Mapping):
            out.append({"name": fn.get("name"), "arguments": preview(fn.get("arguments"))})
    return out


def _content_text(content: object) -> str:
    """The text of a message's content (a string or a list of parts)."""
    if isinstance(content, list):
        return " ".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
        )
    return "" if content is None else str(content)


def staged_entry(
    record: StagedCallRecord, parent_full: array[int] | None, *, orphaned: bool = False
) -> StagedEntry:
    """A staged call as one row of the rollout view (and one ``--follow`` event)."""
    response = record.response
    return {
        "rollout_id": record.rollout_id,
        "seq": record.seq,
        "call_id": record.call_id,
        "status": _staged(record),
        "orphaned": orphaned,
        "finish_reason": record.finish_reason,
        "prompt_tokens": len(record.prompt_token_ids),
        "completion_tokens": len(record.completion_token_ids),
        "parent_call_id": record.parent_call_id,
        "retry_of": record.retry_of,
        "drift": _drift(record, parent_full),
        "weight_version": record.weight_version,
        "created_at_ms": record.created_at_ms,
        "reasoning": preview(response.get("reasoning_content")),
        "content": preview(_content_text(response.get("content"))),
        "tool_calls": _tool_calls(response),
        "attachments": [attachment_entry(a) for a in record.attachments],
    }


def _staged(record: StagedCallRecord) -> Literal["staged"]:
    # A record read from a store is staged by definition; its status is printed as stored.
    return cast(Literal["staged"], record.status.value)


def failure_entry(entry: LedgerEntry) -> FailureEntry:
    """A call that was not staged, as one row of the rollout view: what happened and why."""
    return {
        "rollout_id": entry.rollout_id,
        "seq": entry.seq,
        "call_id": entry.call_id,
        # The ledger holds only calls that were not staged.
        "status": cast(FailureStatus, entry.status.value),
        "reason": entry.reason,
        "http_status": entry.http_status,
        "message": entry.message,
        "at_ms": entry.at_ms,
    }


class _CountedCall(TypedDict):
    """What the overview counts of a staged call, read from its summary alone."""

    status: Literal["staged"]
    orphaned: bool
    prompt_tokens: int
    completion_tokens: int
    created_at_ms: int


_Counted: TypeAlias = StagedEntry | FailureEntry | _CountedCall
T = TypeVar("T")


def entry_time(entry: _Counted) -> int:
    return entry["created_at_ms"] if entry["status"] == "staged" else entry["at_ms"]


def _read(what: str, read: Callable[[], T]) -> T:
    """Run a store read; a damaged store becomes one sentence instead of a traceback."""
    try:
        return read()
    except KeyError:
        raise
    except (ValueError, OSError) as e:
        raise InspectError(f"{what} cannot be read ({e}); run inspect --verify") from e


def _entries(
    store: Store, rollout_id: str, status: RolloutStatus
) -> tuple[list[CallEntry], list[StagedCallRecord]]:
    """Staged calls, ledger failures and calls lost in a crash of a rollout, interleaved by
    seq; and the records."""
    # A debugging view shows everything: open, poisoned and orphaned alike, and each call's
    # digest check is its own line in the call view (and --verify), so no read-time check here.
    records = _read(
        f"rollout {rollout_id!r}",
        lambda: store.calls(
            rollout_id,
            include_orphaned=True,
            include_open=True,
            include_poisoned=True,
            verify=False,
        ),
    )
    orphaned = store.source.orphaned()
    fulls: dict[str, array[int]] = {}
    entries: list[CallEntry] = []
    for r in records:
        parent = fulls.get(r.parent_call_id) if r.parent_call_id else None
        entries.append(staged_entry(r, parent, orphaned=r.call_id in orphaned))
        fulls[r.call_id] = full_sequence(r.prompt_token_ids, r.completion_token_ids)
    entries.extend(failure_entry(f) for f in store.failures(rollout_id))
    entries.extend(_event_log_only(store, rollout_id, status))
    entries.sort(key=lambda e: (e["seq"], entry_time(e)))
    return entries, records


#: What a ``lost_in_crash`` row says (`capture_proxy.read.status`).
LOST_MESSAGE = (
    "admitted (its seq claimed), then neither staged nor in the ledger: the proxy stopped "
    "while the call was in flight, or its record was removed"
)


def _event_log_only(store: Store, rollout_id: str, status: RolloutStatus) -> list[FailureEntry]:
    """The not-staged calls `Store.status` knows of that the ledger does not hold: a claimed
    call with neither a record nor a ledger entry (``lost_in_crash``), and a ledger entry only
    the event log still has. Shown as rows like the ledger's, so inspect lists every call
    `Store.status` does."""
    listed = {f.call_id for f in store.failures(rollout_id)}
    claimed_at = {
        e.call_id: e.at_ms
        for e in _read(f"rollout {rollout_id!r}", lambda: store.source.events(rollout_id))
        if e.kind == "claim"
    }
    return [
        {
            "rollout_id": rollout_id,
            "seq": n.seq,
            "call_id": n.call_id,
            "status": cast(FailureStatus, n.status),
            "reason": n.reason,
            "http_status": None,
            "message": LOST_MESSAGE if n.status == LOST_IN_CRASH else "in the event log only",
            "at_ms": claimed_at.get(n.call_id, 0),
        }
        for n in status.not_staged
        if n.call_id not in listed and n.status != "orphaned"
    ]


def _summary(
    info: RolloutInfo, entries: Sequence[_Counted], status: RolloutStatus
) -> RolloutSummary:
    staged = [e for e in entries if e["status"] == "staged"]
    times = [t for t in map(entry_time, entries) if t]
    return {
        "rollout_id": info.rollout_id,
        "state": info.state.value,
        # As `Store.status` says: the header, the ledger, orphan marks and the event log (a
        # claim neither staged nor in the ledger is lost_in_crash, and poisons).
        "poisoned": status.poisoned,
        "calls": len(entries),
        "statuses": dict(Counter(e["status"] for e in entries)),
        "orphaned": sum(1 for e in staged if e["orphaned"]),
        "prompt_tokens": sum(e["prompt_tokens"] for e in staged),
        "completion_tokens": sum(e["completion_tokens"] for e in staged),
        "created_at_ms": info.created_at_ms,
        "sealed_at_ms": info.sealed_at_ms,
        "first_at_ms": min(times, default=None),
        "last_at_ms": max(times, default=None),
    }


def _counted_entries(store: Store, rollout_id: str) -> list[_Counted]:
    """What `_summary` counts of a rollout, from call summaries: no token ids or messages are
    decoded, so listing a large store costs a few columns per call (``--verify`` reads it all).
    """
    summaries: list[CallSummary] = _read(
        f"rollout {rollout_id!r}", lambda: store.source.summaries(rollout_id)
    )
    entries: list[_Counted] = [
        {
            "status": "staged",
            "orphaned": s.orphaned,
            "prompt_tokens": s.prompt_len,
            "completion_tokens": s.completion_len,
            "created_at_ms": s.created_at_ms,
        }
        for s in summaries
    ]
    entries.extend(failure_entry(f) for f in store.failures(rollout_id))
    return entries


def _status(store: Store, rollout_id: str) -> RolloutStatus:
    return _read(f"rollout {rollout_id!r}", lambda: store.status(rollout_id))


def overview(store: Store) -> OverviewView:
    """Every rollout of the store, newest first, with its counts, tokens and time span."""
    rollouts = []
    for rollout_id in reversed(store.rollouts()):
        status = _status(store, rollout_id)
        entries: list[_Counted] = [
            *_counted_entries(store, rollout_id),
            *_event_log_only(store, rollout_id, status),
        ]
        try:
            info = store.rollout_info(rollout_id)
        except KeyError as e:  # listed (it has records) without a header: only a damaged store
            raise InspectError(
                f"rollout {rollout_id!r} has records but no header: the store is damaged; run "
                "inspect --verify"
            ) from e
        rollouts.append(_summary(info, entries, status))
    view: OverviewView = {"view": "rollouts", "store": store.url, "rollouts": rollouts}
    replicas = _replicas(store)
    if replicas is not None:
        view["replicas"] = replicas
    return view


def _replicas(store: Store) -> list[ReplicaEntry] | None:
    """A running proxy's upstream replicas (empty with a single upstream); None for a store
    read from files, or a proxy too old to say."""
    if not isinstance(store.source, RemoteSource):
        return None
    got = store.source.replicas()
    if got is None:
        return None
    return [
        {
            "replica": r.replica,
            "state": r.state,
            "problem": r.problem,
            "live_rollouts": r.live_rollouts,
            "version": r.version,
            "fingerprint": r.fingerprint,
            "model": r.model,
            "probed_at_ms": r.probed_at_ms,
        }
        for r in got
    ]


def _trajectory(store: Store, rollout_id: str) -> TrajectorySummary | TrajectoryUnavailable:
    # The trajectory builder is the trainer's view; if it fails on this store, inspect still
    # shows everything else and says why the trajectory is missing.
    try:
        t = store.trajectory(rollout_id, include_open=True, include_poisoned=True, verify=False)
    except Exception as e:
        note = f"trajectory unavailable: {type(e).__name__}: {error_text(e)}"
        return {"ok": False, "note": note}
    d = t.to_dict()
    return {
        "ok": True,
        "state": d["state"],
        "poisoned": d["poisoned"],
        "n_failures": d["n_failures"],
        "not_staged": d["not_staged"],
        "tokens": len(t),
        "trained_tokens": sum(t.loss_mask),
        "segments": d["segments"],
        "breaks": [
            {"call_id": b["call_id"], "position": b["position"], "reason": b["reason"]}
            for b in d["breaks"]
        ],
        "drift": d["drift"],
        "apart": d["apart"],
        "retries_skipped": d["retries_skipped"],
    }


def rollout_view(store: Store, rollout_id: str) -> RolloutView:
    """A rollout's calls in order, staged and failed; KeyError for an unknown rollout."""
    if rollout_id not in store.rollouts():
        raise KeyError(rollout_id)
    info = store.rollout_info(rollout_id)
    status = _status(store, rollout_id)
    entries, records = _entries(store, rollout_id, status)
    # `token_in` is added below when there is one (mypy cannot type a spread with it).
    rollout = cast(
        RolloutDetail,
        {
            **_summary(info, entries, status),
            "metadata": dict(info.metadata),
            "outcome": None if info.outcome is None else _outcome(info.outcome),
            "outcomes": len(info.outcome_history),
        },
    )
    token_in = _token_in_summary(store, rollout_id, records)
    if token_in is not None:
        rollout["token_in"] = token_in
    return {
        "view": "rollout",
        "store": store.url,
        "rollout": rollout,
        "calls": entries,
        "last": entries[-1] if entries else None,
        "trajectory": _trajectory(store, rollout_id),
    }


def _token_in_summary(
    store: Store, rollout_id: str, records: Sequence[StagedCallRecord]
) -> TokenInSummary | None:
    """What token-in did in the rollout (None for a rollout that never used or chose it)."""
    events = _read(f"rollout {rollout_id!r}", lambda: store.source.events(rollout_id))
    choice = token_in_choice(events)
    token_in = [r for r in records if r.token_in]
    if choice is None and not token_in:
        return None
    summary: TokenInSummary = {
        "choice": choice,
        "calls": len(token_in),
        "measured": 0,
        "diverged": [],
        "new_segments": [],
    }
    for r in token_in:
        measured, position = plain_divergence_of(r.extras)
        summary["measured"] += measured
        if position is not None:
            summary["diverged"].append({"seq": r.seq, "call_id": r.call_id, "position": position})
        said = segment_break_of(r.extras)
        if said is not None:
            summary["new_segments"].append({"seq": r.seq, "call_id": r.call_id, **said.to_dict()})
    return summary


def _outcome(outcome: RolloutOutcome) -> OutcomeEntry:
    reward = outcome.reward
    return {
        "reward": dict(reward) if isinstance(reward, Mapping) else reward,
        "group_id": outcome.group_id,
        "metadata": None if outcome.metadata is None else dict(outcome.metadata),
        "at_ms": outcome.at_ms,
    }


def find_call(store: Store, call_id: str) -> StagedCallRecord | LedgerEntry:
    """The staged record with that id, else the ledger entry; KeyError when neither exists."""
    try:
        (record,) = _read(f"call {call_id!r}", lambda: store.source.fetch([call_id]))
        return record
    except KeyError:
        pass
    for rollout_id in store.rollouts():
        for entry in store.failures(rollout_id):
            if entry.call_id == call_id:
                return entry
    raise KeyError(call_id)


def _check(record: StagedCallRecord) -> DigestCheck:
    try:
        verify_record(record)
    except DigestMismatch as e:
        return {"ok": False, "problem": str(e)}
    return {"ok": True, "problem": None}


def _tokens(record: StagedCallRecord, text: TokenText | None) -> TokensDetail:
    out: TokensDetail = {
        "prompt_token_ids": record.prompt_token_ids.tolist(),
        "completion_token_ids": record.completion_token_ids.tolist(),
        "completion_logprobs": record.completion_logprobs.tolist(),
    }
    if text is not None:
        out["prompt_text"] = [text(i) for i in record.prompt_token_ids]
        out["completion_text"] = [text(i) for i in record.completion_token_ids]
    return out


def call_view(
    store: Store, call_id: str, *, tokens: bool = False, token_text: TokenText | None = None
) -> CallView:
    """One call in full: request, response, tokens, digests and their check; or its failure."""
    found = find_call(store, call_id)
    if isinstance(found, LedgerEntry):
        return {"view": "call", "store": store.url, "call": failure_entry(found)}
    r = found
    (coords,) = store.coords([r.call_id])
    call: StagedCallDetail = {
        "rollout_id": r.rollout_id,
        "seq": r.seq,
        "call_id": r.call_id,
        "status": _staged(r),
        "orphaned": r.call_id in store.source.orphaned(),
        "parent_call_id": r.parent_call_id,
        "retry_of": r.retry_of,
        "created_at_ms": r.created_at_ms,
        "weight_version": r.weight_version,
        "model": r.model,
        "upstream_version": r.upstream_version,
        "tokenizer_fingerprint": r.tokenizer_fingerprint,
        "schema_version": r.schema_version,
        "finish_reason": r.finish_reason,
        "sampling": dict(r.sampling),
        "request": dict(r.request),
        "response": dict(r.response),
        "extras": dict(r.extras),
        "prompt_tokens": len(r.prompt_token_ids),
        "completion_tokens": len(r.completion_token_ids),
        "stored": {
            "prev_len": coords.prev_len,
            "delta_len": coords.delta_len,
            "cum_len": coords.cum_len,
        },
        "digest": r.digest,
        "extras_digest": r.extras_digest,
        "check": _check(r),
        "attachments": [{**attachment_entry(a), "ok": a.check()} for a in r.attachments],
    }
    _add_v2_fields(call, r)
    if tokens:
        call["tokens"] = _tokens(r, token_text)
    return {"view": "call", "store": store.url, "call": call}


def _add_v2_fields(call: StagedCallDetail, r: StagedCallRecord) -> None:
    """The fields of record schema 2 that say something (not at their "unknown" default)."""
    if r.engine_weight_version is not None:
        call["engine_weight_version"] = r.engine_weight_version
    if r.weight_spans:
        call["weight_spans"] = [list(span) for span in r.weight_spans]
    if r.token_in:
        call["token_in"] = True
        measured, position = plain_divergence_of(r.extras)
        if measured:
            call["plain_divergence"] = position
        said = segment_break_of(r.extras)
        if said is not None:
            call["token_in_break"] = said.to_dict()
    if r.bridge_spans:
        call["bridge_spans"] = [list(span) for span in r.bridge_spans]
    if r.replica:
        call["replica"] = r.replica
    if r.effective_sampling is not None:
        call["effective_sampling"] = dict(r.effective_sampling)
    if r.logprobs_mode != LOGPROBS_MODE_UNKNOWN:
        call["logprobs_mode"] = r.logprobs_mode


def verify_view(
    store: Store, *, progress: Progress | None = None, expected_store_head: str | None = None
) -> VerifyView:
    """Every digest and attachment checked; `ok` is false when any problem was found.
    `progress` is told how far the check is (`Store.problems`); `expected_store_head` is the
    store head an operator kept (``HEAD[:ROLLOUTS[:EVENTS]]``)."""
    checked = len(list(store.source.all_keys()))
    problems: list[VerifyProblem] = [
        {"key": p.key, "message": p.message}
        for p in store.problems(progress=progress, expected_store_head=expected_store_head)
    ]
    return {
        "view": "verify",
        "store": store.url,
        "ok": not problems,
        "checked": checked,
        "problems": problems,
    }
