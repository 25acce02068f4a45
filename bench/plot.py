"""The PNG of docs/reports/performance.md: added latency against concurrency, per target.

Reads the summary `bench_proxy.py` builds (closed-loop scenarios ``unary-fast-closed<N>``).
matplotlib is a bench-only dependency (``.venv/bin/pip install matplotlib``); without it the
plot is skipped with a message, and the table is still printed.

    .venv/bin/python bench/plot.py results.json docs/reports/performance-latency.png
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import orjson

__all__ = ["plot_added_latency"]

_SERIES = {"passthrough": "#777777", "sqlite": "#1f77b4", "parquet": "#d62728"}


def plot_added_latency(summary: dict[str, dict[str, dict[str, Any]]], out: Path) -> str:
    """Draw the plot into `out`; returns a one-line message saying what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    points: dict[str, list[tuple[int, float, float]]] = {t: [] for t in _SERIES}
    for name, table in summary.items():
        m = re.fullmatch(r"unary-fast-closed(\d+)", name)
        if not m:
            continue
        for t in _SERIES:
            f = table.get(t)
            if f and f.get("added50") is not None and f.get("added99") is not None:
                points[t].append((int(m.group(1)), f["added50"], f["added99"]))
    if not any(points.values()):
        return "plot skipped: no closed-loop scenarios in this run"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for t, pts in points.items():
        if not pts:
            continue
        pts.sort()
        xs = [p[0] for p in pts]
        # A log axis: an added latency at or under 0.1 ms (noise) is drawn at 0.1.
        ax.plot(xs, [max(p[1], 0.1) for p in pts], "o-", color=_SERIES[t], label=f"{t} p50")
        ax.plot(
            xs,
            [max(p[2], 0.1) for p in pts],
            "s--",
            color=_SERIES[t],
            alpha=0.6,
            label=f"{t} p99",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent clients (closed loop, fast upstream, non-streaming)")
    ax.set_ylabel("added latency vs direct (ms)")
    ax.set_title("Latency added by the proxy, 16k-prompt / 1k-completion calls")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return f"plot written to {out}"


if __name__ == "__main__":
    data = orjson.loads(Path(sys.argv[1]).read_bytes())
    print(plot_added_latency(data["summary"], Path(sys.argv[2])))
