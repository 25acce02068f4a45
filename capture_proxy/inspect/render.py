"""Drawing `inspect` views for people, as lines and tables on an `Out`.

Every ``render_*`` function takes a view from `capture_proxy.inspect.views` (typed in
`capture_proxy.inspect.shapes`) and an `Out`,
the surface it draws on: `capture_proxy.inspect.cli.RichOut` on a terminal (tables sized to it,
long previews cut to fit), `capture_proxy.inspect.cli.PlainOut` anywhere else (aligned columns,
no colour, no width limit, for pipes, files and ``grep``). Neither interprets markup: a message
that contains ``[red]`` prints as ``[red]``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import orjson

from .shapes import (
    AttachmentEntry,
    CallEntry,
    CallView,
    OverviewView,
    ReplicaEntry,
    RolloutDetail,
    RolloutSummary,
    RolloutView,
    StagedCallDetail,
    TokenInSummary,
    TokensDetail,
    TrajectorySummary,
    TrajectoryUnavailable,
    VerifyView,
)
from .views import preview

__all__ = [
    "Column",
    "Out",
    "event_line",
    "fmt_size",
    "fmt_span",
    "fmt_time",
    "render_call",
    "render_overview",
    "render_rollout",
    "render_tokens",
    "render_verify",
]


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    #: Numbers are right-aligned.
    numeric: bool = False
    #: Share of the leftover width this column gets; 0 keeps its natural width. Flexible
    #: columns are cut with an ellipsis when the terminal is narrow.
    flex: int = 0
    #: When a terminal is too narrow for every column, higher numbers are hidden first;
    #: 0 is never hidden. Columns with nothing in them are hidden whenever they may be.
    hide: int = 0


class Out(Protocol):
    """Where a view is drawn: lines (an alert is shown loudly) and tables."""

    def line(self, text: str = "", *, alert: bool = False, strong: bool = False) -> None: ...

    def table(
        self, columns: Sequence[Column], rows: Sequence[Sequence[str]], alerts: Sequence[bool]
    ) -> None: ...


# -- formatting ---------------------------------------------------------------------------------


def fmt_time(ms: int | None) -> str:
    if not ms:
        return "-"
    try:
        return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError):  # a time no clock gives (a crafted store)
        return f"{ms} ms?"


def fmt_span(first: int | None, last: int | None) -> str:
    if not first or not last:
        return "-"
    s = max(0, (last - first) // 1000)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024 / 1024:.1f} MiB"


def _statuses(counts: Mapping[str, int], *, skip_staged: bool) -> str:
    parts = [f"{n} {s}" for s, n in sorted(counts.items()) if not (skip_staged and s == "staged")]
    return ", ".join(parts) or "-"


def _attachment(a: AttachmentEntry, *, full: bool = False) -> str:
    sha = a["sha256"] if full else a["sha256"][:12]
    return f"{a['media_type']} {fmt_size(a['size'])} sha256:{sha}"


def _json(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


# -- store overview -----------------------------------------------------------------------------

_OVERVIEW = (
    Column("ROLLOUT"),
    Column("STATE", hide=3),
    Column("POISONED"),
    Column("CALLS", numeric=True),
    Column("NOT STAGED", flex=1),
    Column("PROMPT", numeric=True, hide=2),
    Column("COMPLETION", numeric=True, hide=2),
    Column("FIRST CALL (UTC)", hide=4),
    Column("SPAN", numeric=True, hide=1),
)


_REPLICAS = (
    Column("REPLICA"),
    Column("STATE"),
    Column("LIVE ROLLOUTS", numeric=True, hide=1),
    Column("PROBLEM", flex=1),
)


def render_overview(view: OverviewView, out: Out) -> None:
    _render_rollouts(view["rollouts"], view["store"], out)
    # A single upstream (or a store read from files) says nothing: only a fleet has replicas.
    replicas = view.get("replicas", [])
    if replicas:
        _render_replicas(replicas, out)


def _render_replicas(replicas: Sequence[ReplicaEntry], out: Out) -> None:
    unwell = sum(r["state"] != "healthy" for r in replicas)
    out.line(
        f"{len(replicas)} upstream replica(s) behind the proxy"
        + (f", {unwell} not healthy" if unwell else ", all healthy"),
        strong=True,
    )
    rows = [
        [r["replica"], r["state"], str(r["live_rollouts"]), r["problem"] or "-"] for r in replicas
    ]
    out.table(_REPLICAS, rows, [r["state"] != "healthy" for r in replicas])


def _render_rollouts(rollouts: Sequence[RolloutSummary], store: str, out: Out) -> None:
    out.line(f"{len(rollouts)} rollout(s) in {store}, newest first", strong=True)
    if not rollouts:
        out.line("(no rollouts yet)")
        return
    rows = [
        [
            r["rollout_id"],
            r["state"],
            "POISONED" if r["poisoned"] else "",
            str(r["calls"]),
            _statuses(r["statuses"], skip_staged=True),
            str(r["prompt_tokens"]),
            str(r["completion_tokens"]),
            fmt_time(r["first_at_ms"]),
            fmt_span(r["first_at_ms"], r["last_at_ms"]),
        ]
        for r in rollouts
    ]
    out.table(_OVERVIEW, rows, [r["poisoned"] for r in rollouts])
    poisoned = [r["rollout_id"] for r in rollouts if r["poisoned"]]
    if poisoned:
        out.line(
            f"POISONED: {', '.join(poisoned)} (a call was answered but not staged; "
            "inspect --rollout ID shows which)",
            alert=True,
        )


# -- one rollout --------------------------------------------------------------------------------

_ROLLOUT = (
    Column("SEQ", numeric=True),
    Column("CALL"),
    Column("STATUS"),
    Column("FINISH", hide=3),
    Column("PROMPT", numeric=True, hide=2),
    Column("COMPL", numeric=True, hide=2),
    Column("PARENT", hide=4),
    Column("DRIFT", hide=1),
    Column("PREVIEW", flex=3),
    Column("ATTACHMENTS", flex=1, hide=5),
)


def _preview_cell(e: CallEntry) -> str:
    """What the call did (staged) or why it failed (not staged), in one line."""
    if e["status"] != "staged":
        http = f"HTTP {e['http_status']} " if e.get("http_status") else ""
        return f"{http}{e['reason']}: {preview(e['message'], 160)}"
    parts = []
    if e["reasoning"]:
        parts.append(f"think: {e['reasoning']}")
    if e["content"]:
        parts.append(f"text: {e['content']}")
    parts.extend(f"tool: {tc['name']}({tc['arguments']})" for tc in e["tool_calls"])
    return " | ".join(parts) or "(empty answer)"


def _ref(call_id: str | None, seq_of: Mapping[str, int]) -> str:
    if call_id is None:
        return ""
    return f"#{seq_of[call_id]}" if call_id in seq_of else call_id


def call_row(e: CallEntry, seq_of: Mapping[str, int]) -> list[str]:
    if e["status"] != "staged":
        # Not staged: no finish reason, tokens, parent, drift or attachments to show.
        return [
            str(e["seq"]),
            e["call_id"],
            e["status"],
            "-",
            "-",
            "-",
            "-",
            "",
            _preview_cell(e),
            "",
        ]
    parent = _ref(e["parent_call_id"], seq_of)
    if e["retry_of"]:
        parent = f"{parent} retry of {_ref(e['retry_of'], seq_of)}".strip()
    drift = e["drift"]
    return [
        str(e["seq"]),
        e["call_id"],
        "staged, ORPHANED" if e["orphaned"] else e["status"],
        e["finish_reason"],
        str(e["prompt_tokens"]),
        str(e["completion_tokens"]),
        parent or "-",
        f"at {drift['position']}/{drift['parent_len']}" if drift else "",
        _preview_cell(e),
        ", ".join(_attachment(a) for a in e["attachments"]),
    ]


def event_line(e: CallEntry, seq_of: Mapping[str, int]) -> str:
    """A call as one labelled line, for ``--follow`` (a table cannot grow)."""
    head = [f"#{e['seq']}", e["call_id"], call_row(e, seq_of)[2]]
    tail = [_preview_cell(e)]
    if e["status"] == "staged":
        head += [
            e["finish_reason"],
            f"prompt {e['prompt_tokens']}",
            f"completion {e['completion_tokens']}",
        ]
        if e["parent_call_id"]:
            head.append(f"parent {_ref(e['parent_call_id'], seq_of)}")
        if e["retry_of"]:
            head.append(f"retry of {_ref(e['retry_of'], seq_of)}")
        if e["drift"]:
            head.append(f"DRIFT at {e['drift']['position']}/{e['drift']['parent_len']}")
        tail += [_attachment(a) for a in e["attachments"]]
    return " ".join(head) + " | " + " | ".join(tail)


def _is_alert(e: CallEntry) -> bool:
    return e["status"] != "staged" or bool(e.get("orphaned"))


def render_rollout(view: RolloutView, out: Out) -> None:
    r, calls = view["rollout"], view["calls"]
    out.line(
        f"Rollout {r['rollout_id']} ({r['state']}) in {view['store']}: {r['calls']} call(s) "
        f"[{_statuses(r['statuses'], skip_staged=False)}], prompt {r['prompt_tokens']} / "
        f"completion {r['completion_tokens']} tokens, first call {fmt_time(r['first_at_ms'])} "
        f"UTC, span {fmt_span(r['first_at_ms'], r['last_at_ms'])}",
        strong=True,
    )
    if r["poisoned"]:
        bad = [
            f"#{e['seq']} {e['call_id']} ({'orphaned' if e['status'] == 'staged' else e['reason']})"
            for e in calls
            if e["status"] in ("capture_failed", "lost_in_crash") or e.get("orphaned")
        ]
        out.line(
            "POISONED: answered but not staged: " + ", ".join(bad) + ". The trajectory is "
            "missing these calls; do not train on it as if complete.",
            alert=True,
        )
    if r["metadata"]:
        out.line(f"metadata: {_json(r['metadata'])}")
    if "token_in" in r:
        out.line(_token_in_line(r["token_in"]))
    _render_outcome(r, out)
    if not calls:
        out.line("(no calls yet)")
    else:
        seq_of = {e["call_id"]: e["seq"] for e in calls}
        out.table(_ROLLOUT, [call_row(e, seq_of) for e in calls], [_is_alert(e) for e in calls])
    last = view["last"]
    if last is not None and last["status"] != "staged":
        http = f"HTTP {last['http_status']}, " if last["http_status"] else ""
        out.line(
            f"Last call #{last['seq']} {last['call_id']} was {last['status']} "
            f"({http}{last['reason']}): {last['message']}",
            alert=True,
        )
    elif last is not None:
        out.line(f"Last call #{last['seq']} staged, finish reason {last['finish_reason']}.")
    _render_trajectory(view["trajectory"], out)


def _token_in_line(t: TokenInSummary) -> str:
    choice = {None: "the proxy's setting", True: "on", False: "off"}[t["choice"]]
    text = f"token-in: {choice} for this rollout; {t['calls']} token-in call(s)"
    if t["measured"]:
        where = ", ".join(f"#{d['seq']} at token {d['position']}" for d in t["diverged"])
        text += (
            f"; plain rendering would have diverged in {len(t['diverged'])} of "
            f"{t['measured']}" + (f" ({where})" if where else "")
        )
    if t["new_segments"]:
        text += "; new segments: " + ", ".join(
            f"#{s['seq']} {s['reason']}" for s in t["new_segments"]
        )
    return text


def _render_outcome(r: RolloutDetail, out: Out) -> None:
    o = r["outcome"]
    if o is None:
        return
    reward = "-" if o["reward"] is None else _json(o["reward"])
    earlier = f"; {r['outcomes'] - 1} earlier, replaced" if r["outcomes"] > 1 else ""
    out.line(
        f"outcome: reward {reward}, group {o['group_id'] or '-'} "
        f"(sent {fmt_time(o['at_ms'])} UTC{earlier})"
    )
    if o["metadata"]:
        out.line(f"outcome metadata: {_json(o['metadata'])}")


def _render_trajectory(t: TrajectorySummary | TrajectoryUnavailable, out: Out) -> None:
    if t["ok"] is False:
        out.line(t["note"])
        return
    flags = [t["state"]]
    if t["poisoned"]:
        flags.append("POISONED")
    flags.append(f"{t['n_failures']} not staged")
    text = (
        f"Trajectory ({', '.join(flags)}): {t['tokens']} tokens ({t['trained_tokens']} "
        f"generated), {len(t['segments'])} segment(s)"
    )
    if t["drift"]:
        text += "; drift: " + ", ".join(
            f"{d['call_id']} at token {d['position']} of {d['parent_len']}" for d in t["drift"]
        )
    else:
        text += ", no drift"
    if t["breaks"]:
        text += "; breaks: " + ", ".join(
            f"{b['reason']} at token {b['position']} ({b['call_id']})" for b in t["breaks"]
        )
    if t["apart"]:
        text += f"; kept apart (no tools): {', '.join(t['apart'])}"
    if t["retries_skipped"]:
        text += f"; retried attempts skipped: {', '.join(t['retries_skipped'])}"
    out.line(text, alert=t["poisoned"])


# -- one call -----------------------------------------------------------------------------------


def _fields(out: Out, pairs: Sequence[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in pairs)
    for k, v in pairs:
        out.line(f"  {k.ljust(width)}  {v}", alert=v.startswith("FAILED"))


def _block(out: Out, text: str, indent: int = 6) -> None:
    pad = " " * indent
    for line in str(text).splitlines() or [""]:
        out.line(pad + line)


def _part(part: Any, attachments: Mapping[str, AttachmentEntry]) -> str:
    if not isinstance(part, Mapping):
        return _json(part)
    kind = part.get("type")
    if kind == "text":
        return str(part.get("text", ""))
    ref = part.get(str(kind)) if isinstance(kind, str) else None
    url = ref.get("url") if isinstance(ref, Mapping) else None
    if isinstance(url, str) and url.startswith("attachment:sha256:"):
        sha = url.removeprefix("attachment:sha256:")
        a = attachments.get(sha)
        label = str(kind).removesuffix("_url").removeprefix("input_")  # image_url -> image
        if a is None:
            return f"[{label} sha256:{sha}, MISSING from the store]"
        return f"[{label} {_attachment(a, full=True)}]"
    return f"[{kind}: {_json(ref)}]"


def _message(
    out: Out, label: str, m: Mapping[str, Any], atts: Mapping[str, AttachmentEntry]
) -> None:
    extra = f" (tool_call_id {m['tool_call_id']})" if m.get("tool_call_id") else ""
    if m.get("name"):
        extra += f" (name {m['name']})"
    out.line(f"  {label}{m.get('role', '?')}{extra}", strong=True)
    if m.get("reasoning_content"):
        out.line("      reasoning:")
        _block(out, m["reasoning_content"], 8)
    content = m.get("content")
    if isinstance(content, list):
        for part in content:
            _block(out, _part(part, atts))
    elif content:
        _block(out, content)
    for tc in m.get("tool_calls") or ():
        fn = tc.get("function") or {}
        out.line(f"      tool call {fn.get('name')} (id {tc.get('id')}): {fn.get('arguments')}")


def _extra(key: str, value: Any) -> str:
    # routed_experts and the like are large: name them with their size instead of dumping them.
    text = _json(value)
    return f"{key}={text}" if len(text) <= 40 else f"{key} ({len(text)} B of JSON)"


def _v2_pairs(c: StagedCallDetail) -> list[tuple[str, str]]:
    """Lines for the fields of record schema 2 the call has (absent ones are not shown)."""
    pairs: list[tuple[str, str]] = []
    if "effective_sampling" in c:
        applied = " ".join(f"{k}={_json(v)}" for k, v in sorted(c["effective_sampling"].items()))
        pairs.append(("effective sampling", applied or "-"))
    if "logprobs_mode" in c:
        pairs.append(("logprobs mode", c["logprobs_mode"]))
    if "engine_weight_version" in c:
        pairs.append(("engine weights", c["engine_weight_version"]))
    if "weight_spans" in c:
        spans = ", ".join(f"{v} [{a}, {b})" for v, a, b in c["weight_spans"])
        pairs.append(("weight spans", f"{spans} (completion positions)"))
    if "token_in" in c:
        pairs.append(("token-in", "yes"))
    if "bridge_spans" in c:
        spans = ", ".join(f"[{a}, {b}) {why}" for a, b, why in c["bridge_spans"])
        pairs.append(("inserted by proxy", f"{spans} (prompt positions)"))
    if "plain_divergence" in c:
        at = c["plain_divergence"]
        pairs.append(
            (
                "plain rendering",
                "would have been the same"
                if at is None
                else f"would have diverged at prompt token {at}",
            )
        )
    if "token_in_break" in c:
        said = c["token_in_break"]
        detail = f": {said['detail']}" if said["detail"] else ""
        pairs.append(("new segment", f"{said['reason']}{detail}"))
    if "replica" in c:
        pairs.append(("replica", c["replica"]))
    return pairs


def render_call(view: CallView, out: Out) -> None:
    c = view["call"]
    if c["status"] != "staged":
        out.line(f"Call {c['call_id']} was {c['status']}, not staged", alert=True)
        http = str(c["http_status"]) if c["http_status"] else "-"
        _fields(
            out,
            [
                ("rollout", f"{c['rollout_id']} (seq {c['seq']})"),
                ("reason", c["reason"]),
                ("http status", http),
                ("message", c["message"]),
                ("at", f"{fmt_time(c['at_ms'])} UTC"),
            ],
        )
        out.line("  (a call that was not staged keeps no request or tokens, only this entry)")
        return
    check = c["check"]
    s = c["stored"]
    out.line(
        f"Call {c['call_id']} ({c['status']}{', ORPHANED' if c['orphaned'] else ''})",
        alert=c["orphaned"] or not check["ok"],
        strong=True,
    )
    atts: dict[str, AttachmentEntry] = {a["sha256"]: a for a in c["attachments"]}
    pairs = [
        ("rollout", f"{c['rollout_id']} (seq {c['seq']})"),
        ("parent", c["parent_call_id"] or "-"),
        ("retry of", c["retry_of"] or "-"),
        ("created", f"{fmt_time(c['created_at_ms'])} UTC"),
        (
            "model",
            f"{c['model']} (upstream {c['upstream_version'] or '?'}), "
            f"weight version {c['weight_version']}",
        ),
        ("tokenizer", c["tokenizer_fingerprint"] or "-"),
        ("finish reason", c["finish_reason"]),
        (
            "tokens",
            f"prompt {c['prompt_tokens']} + completion {c['completion_tokens']} = "
            f"{s['cum_len']} (stored: {s['delta_len']} after {s['prev_len']} shared with the "
            "parent)",
        ),
        ("sampling", " ".join(f"{k}={_json(v)}" for k, v in sorted(c["sampling"].items())) or "-"),
        *_v2_pairs(c),
        ("extras", ", ".join(_extra(k, v) for k, v in sorted(c["extras"].items())) or "-"),
        ("digest", c["digest"]),
        ("extras digest", c["extras_digest"]),
        ("check", "ok" if check["ok"] else f"FAILED: {check['problem']}"),
    ]
    pairs += [
        ("attachment", f"{_attachment(a, full=True)} {'ok' if a['ok'] else 'FAILED'}")
        for a in c["attachments"]
    ]
    _fields(out, pairs)
    request = dict(c["request"])
    messages = request.pop("messages", [])
    tools = request.pop("tools", None) or []
    out.line("Request", strong=True)
    params = " ".join(f"{k}={_json(v)}" for k, v in sorted(request.items()))
    out.line(f"  params: {params or '-'}")
    if tools:
        names = [str((t.get("function") or {}).get("name")) for t in tools]
        out.line(f"  tools ({len(tools)}): {', '.join(names)}")
    out.line(f"  messages ({len(messages)}):")
    for i, m in enumerate(messages):
        _message(out, f"[{i}] ", m, atts)
    out.line("Response", strong=True)
    _message(out, "", c["response"], atts)
    if "tokens" in c:
        render_tokens(c["tokens"], out)


def _token(text: str) -> str:
    return _json(text)  # quoted and escaped: a leading space or a newline stays visible


def render_tokens(t: TokensDetail, out: Out) -> None:
    prompt, completion = t["prompt_token_ids"], t["completion_token_ids"]
    out.line(f"Prompt token ids ({len(prompt)})", strong=True)
    if "prompt_text" in t:
        rows = [
            [str(i), str(tid), _token(x)]
            for i, (tid, x) in enumerate(zip(prompt, t["prompt_text"], strict=True))
        ]
        cols = [Column("POS", numeric=True), Column("ID", numeric=True), Column("TEXT", flex=1)]
        out.table(cols, rows, [False] * len(rows))
    else:
        for chunk in textwrap.wrap(" ".join(map(str, prompt)), 96) or ["-"]:
            out.line("  " + chunk)
    out.line(f"Completion token ids ({len(completion)})", strong=True)
    texts = t.get("completion_text")
    rows = []
    for i, (tid, lp) in enumerate(zip(completion, t["completion_logprobs"], strict=True)):
        row = [str(i), str(tid), f"{lp:.6f}"]
        if texts is not None:
            row.append(_token(texts[i]))
        rows.append(row)
    cols = [
        Column("POS", numeric=True),
        Column("ID", numeric=True),
        Column("LOGPROB", numeric=True),
    ]
    if texts is not None:
        cols.append(Column("TEXT", flex=1))
    out.table(cols, rows, [False] * len(rows))


# -- verify -------------------------------------------------------------------------------------


def render_verify(view: VerifyView, out: Out) -> None:
    if view["ok"]:
        out.line(f"ok: {view['checked']} record(s) in {view['store']} verify", strong=True)
        return
    problems = view["problems"]
    out.line(
        f"{len(problems)} problem(s) in {view['store']} ({view['checked']} record(s) checked):",
        alert=True,
    )
    for p in problems:
        out.line(f"  {p['key']}: {p['message']}", alert=True)
