"""Turn the benchmark's runs into medians, ratios, a markdown table and the goals of issue 7
(and of token-in beside the plain captured call)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["GOALS", "render_markdown", "summarize"]

CAPTURE = ("sqlite", "parquet")
#: The token-in target and the plain captured call it is compared with (same proxy, same store).
TOKEN_IN, PLAIN = "token-in", "sqlite"
_FIGURES = ("cpu_ms", "p50", "p99", "ttfb50", "ttfb99", "rate", "added50", "added99", "added_ttfb")


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def _median(values: Iterable[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def _per_run(run: dict[str, Any]) -> dict[str, float | None]:
    lat, ttfb = run["latencies"], run["ttfbs"]
    ok = run["ok"]
    cpu = run.get("cpu_s")
    return {
        "cpu_ms": 1000 * cpu / ok if cpu is not None and ok else None,
        "p50": 1000 * pct(lat, 50) if lat else None,
        "p99": 1000 * pct(lat, 99) if lat else None,
        "ttfb50": 1000 * pct(ttfb, 50) if ttfb else None,
        "ttfb99": 1000 * pct(ttfb, 99) if ttfb else None,
        "rate": ok / run["elapsed"] if run["elapsed"] else None,
    }


def is_proxy(target: str) -> bool:
    """A capture-proxy target (``sqlite``, ``parquet-asyncio``, ``base-sqlite``, ...)."""
    return target not in ("direct", "passthrough")


def base_of(target: str) -> str | None:
    """The ``base-`` target `target` is compared with (``sqlite-asyncio`` -> ``base-sqlite``)."""
    if not is_proxy(target) or target.startswith("base-"):
        return None
    if target == TOKEN_IN:
        return "base-" + TOKEN_IN
    return "base-" + target.partition("-")[0]


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def summarize(
    runs: list[dict[str, Any]], scenarios: Sequence[Any], targets: Sequence[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """{scenario: {target: figures}}: medians over repeats, added = minus direct, x = / pass."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for sc in scenarios:
        mine = [r for r in runs if r["scenario"] == sc.name]
        reps = sorted({r["repeat"] for r in mine})
        per: dict[tuple[str, int], dict[str, float | None]] = {
            (r["target"], r["repeat"]): _per_run(r) for r in mine
        }
        for figs in per.values():
            figs.update(added50=None, added99=None, added_ttfb=None)
        for (t, rep), f in per.items():
            d = per.get(("direct", rep))
            if d is not None and t != "direct":
                f["added50"] = _sub(f["p50"], d["p50"])
                f["added99"] = _sub(f["p99"], d["p99"])
                f["added_ttfb"] = _sub(f["ttfb50"], d["ttfb50"])
        table: dict[str, dict[str, Any]] = {}
        for t in targets:
            rows = [per[(t, rep)] for rep in reps if (t, rep) in per]
            if not rows:
                continue
            tr = [r for r in mine if r["target"] == t]
            fig: dict[str, Any] = {k: _median(row[k] for row in rows) for k in _FIGURES}
            fig["ok"] = sum(r["ok"] for r in tr)
            fig["errors"] = sum(r["errors"] for r in tr)
            fig["error_samples"] = sorted({e for r in tr for e in r["error_samples"]})[:3]
            rss = [r["peak_rss_mb"] for r in tr if "peak_rss_mb" in r]
            fig["peak_rss_mb"] = max(rss) if rss else None
            if is_proxy(t):
                for key, base in (
                    ("cpu_x", "cpu_ms"),
                    ("added50_x", "added50"),
                    ("added99_x", "added99"),
                    ("ttfb_x", "added_ttfb"),
                ):
                    fig[key] = _median(
                        _ratio(per[(t, rep)][base], per[("passthrough", rep)][base])
                        for rep in reps
                        if (t, rep) in per and ("passthrough", rep) in per
                    )
            if t == TOKEN_IN:
                pairs = [
                    (per[(t, rep)], per[(PLAIN, rep)])
                    for rep in reps
                    if (t, rep) in per and (PLAIN, rep) in per
                ]
                fig["cpu_x_plain"] = _median(_ratio(a["cpu_ms"], b["cpu_ms"]) for a, b in pairs)
                fig["added50_over_plain"] = _median(
                    _sub(a["added50"], b["added50"]) for a, b in pairs
                )
            before = base_of(t)
            if before is not None:
                for key, base in (("cpu_vs_base", "cpu_ms"), ("added50_vs_base", "added50")):
                    fig[key] = _median(
                        _ratio(per[(t, rep)][base], per[(before, rep)][base])
                        for rep in reps
                        if (t, rep) in per and (before, rep) in per
                    )
            table[t] = fig
        out[sc.name] = table
    return out


#: (scenario name or its prefix, figure, limit, what): the goals of issue 7, per capture target.
GOALS = (
    ("unary-200ms-poisson100", "cpu_x", 1.5, "CPU per call <= 1.5x pass-through"),
    ("unary-200ms-poisson100", "added50_x", 1.5, "added p50 <= 1.5x pass-through"),
    ("unary-200ms-poisson100", "added99_x", 2.0, "added p99 <= 2x pass-through"),
    ("unary-200ms-sequential", "added50", 3.0, "one call at a time: added p50 <= 3 ms"),
    ("unary-200ms-sequential", "added50_x", 3.0, "one call at a time: added p50 <= 3x pass"),
    ("unary-200ms-one-session", "added50", 3.0, "one session's calls: added p50 <= 3 ms"),
    ("unary-200ms-one-session", "added50_x", 3.0, "one session: added p50 <= 3x pass"),
    ("stream-200ms-poisson", "ttfb_x", 1.5, "stream added TTFB <= 1.5x pass-through"),
    ("stream-200ms-poisson", "cpu_x", 2.0, "stream CPU (1k chunks) <= 2x pass-through"),
    ("stream-burst-closed256", "peak_rss_mb", 300.0, "256 open streams: RSS <= 300 MB"),
)
#: (figure, limit, what): the goals of a token-in call beside the plain captured call.
TOKEN_IN_GOALS = (
    ("cpu_x_plain", 1.5, "CPU per call <= 1.5x the plain captured call"),
    ("added50_over_plain", 5.0, "added p50 <= the plain captured call's + 5 ms"),
)


def _fmt(v: Any, digits: int = 2, suffix: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}{suffix}"
    return f"{v}{suffix}"


def render_markdown(
    summary: dict[str, dict[str, dict[str, Any]]], scenarios: Sequence[Any], info: dict[str, Any]
) -> str:
    lines = [
        f"Machine: {info['cpus']} CPUs ({info['cpu_model']}), Python {info['python']}; "
        f"{info['date']}; load average {info['loadavg_start']:.1f} at start, "
        f"{info.get('loadavg_end', 0):.1f} at end; {info['repeats']} repeat(s); "
        f"{info.get('elapsed_s', '?')} s.",
        f"Command: `.venv/bin/python {info['command']}`",
        "",
        "| scenario | target | CPU ms/call | × pass | p50 ms | added p50 | × pass | added p99 "
        "| × pass | added TTFB p50 | × pass | calls/s | peak RSS MB | errors |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for sc in scenarios:
        table = summary.get(sc.name, {})
        for t, f in table.items():
            lines.append(
                f"| {sc.name} | {t} | {_fmt(f['cpu_ms'])} | {_fmt(f.get('cpu_x'), 2, '×')} "
                f"| {_fmt(f['p50'], 1)} | {_fmt(f['added50'])} "
                f"| {_fmt(f.get('added50_x'), 2, '×')} "
                f"| {_fmt(f['added99'])} | {_fmt(f.get('added99_x'), 2, '×')} "
                f"| {_fmt(f['added_ttfb'] if sc.stream else None)} "
                f"| {_fmt(f.get('ttfb_x') if sc.stream else None, 2, '×')} "
                f"| {_fmt(f['rate'], 0)} | {_fmt(f['peak_rss_mb'], 0)} | {f['errors']} |"
            )
    against = [
        (sc.name, t, f)
        for sc in scenarios
        for t, f in summary.get(sc.name, {}).items()
        if f.get("cpu_vs_base") is not None or f.get("added50_vs_base") is not None
    ]
    if against:
        lines += [
            "",
            "Against the base checkout (medians of the per-repeat ratios to base-<store>):",
            "",
            "| scenario | target | CPU ms/call | × base | added p50 | × base |",
            "|---|---|--:|--:|--:|--:|",
        ]
        lines += [
            f"| {name} | {t} | {_fmt(f['cpu_ms'])} | {_fmt(f.get('cpu_vs_base'), 3, '×')} "
            f"| {_fmt(f['added50'])} | {_fmt(f.get('added50_vs_base'), 3, '×')} |"
            for name, t, f in against
        ]
    lines += ["", "Goals (issue 7), per capture store:", ""]
    for name, key, limit, what in GOALS:
        goal_table = next((t for sc, t in summary.items() if sc.startswith(name)), None)
        if not goal_table:
            continue
        for t in CAPTURE:
            figures = goal_table.get(t)
            if figures is None:
                continue
            v = figures.get(key)
            if v is None:
                status = "not measured"
            else:
                ok = v <= limit and (key != "peak_rss_mb" or figures["errors"] == 0)
                status = ("met" if ok else "NOT met") + f" ({_fmt(v)})"
            lines.append(f"- {t}: {what}: {status}")
    token_in = [(sc, table[TOKEN_IN]) for sc, table in summary.items() if TOKEN_IN in table]
    if token_in:
        lines += ["", "Token-in beside the plain captured call (sqlite), same repeat:", ""]
    for sc, figures in token_in:
        for key, limit, what in TOKEN_IN_GOALS:
            v = figures.get(key)
            status = "not measured" if v is None else ("met" if v <= limit else "NOT met")
            lines.append(f"- {sc}: {what}: {status} ({_fmt(v)})")
    errors = [
        (sc, t, f["error_samples"])
        for sc, table in summary.items()
        for t, f in table.items()
        if f["errors"]
    ]
    if errors:
        lines += ["", "Errors seen:"]
        lines += [f"- {sc} / {t}: {samples}" for sc, t, samples in errors]
    return "\n".join(lines) + "\n"
