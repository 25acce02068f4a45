"""A Parquet proxy's memory over a long soak, split by where it lives, per minute and per call.

    .venv/bin/python bench/bench_soak_memory.py --minutes 30 [--store parquet] [--dir D]
    .venv/bin/python bench/bench_soak_memory.py --summarize D/probe/probe.jsonl [--from-minute 6]

The first form runs ``python -m scripts.soak --store parquet --minutes 30 --concurrency 64`` with
`bench/soak_probe` in the proxy (``SOAK_PROBE_OUT=D/probe``, the folder on ``PYTHONPATH``): the
soak's own checks (every acknowledged call in the store, counts, a sample verified) and its RSS
slope, checked against ``--max-rss-slope`` (default 0.5 MiB/min, issue 32's check), then the
probe's lines summarized as in the second form. ``D`` defaults to a new temporary folder; the
store stays in ``D/store`` (``D/store/ds``: the dataset, for `bench/bench_reader_index.py`).

The summary fits each of the probe's series (RSS, anonymous memory, glibc's heap in use and
free, resident memory of glibc's main heap and other arenas, the threads' stacks, mimalloc's
reservation, the rest of the anonymous memory, malloc's own mmaps, Python's arenas and blocks
in use, mimalloc's pool in use) after `--from-minute` (default: the first fifth, as the soak
fits RSS): against time (MiB/min) and against the calls the store holds (bytes per call), and
projects the per-call figure to 167 calls/s (the rate of a quiet two-core machine, issue 19's
soak). It prints the load average at the start and the end: on a shared machine the rate, and so the
slope per minute, follow the other work; bytes per call compare across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: The rate a quiet machine sustained in issue 19's 10-minute Parquet soak (calls/s).
FULL_RATE = 167.0
SERIES = (
    "rss",
    "anonymous",
    "heap_used",
    "heap_free",
    "rss_heap",
    "rss_arenas",
    "rss_stacks",
    "rss_reserve",
    "rss_anon_other",
    "mmapped",
    "py_arenas",
    "py_used",
    "arrow_mimalloc",
    "threads",
)


def _fit(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def summarize(lines: list[dict[str, Any]], from_minute: float | None = None) -> dict[str, Any]:
    """The probe's series fitted after `from_minute` (default: the first fifth of the run)."""
    if not lines:
        raise SystemExit("no probe lines: was SOAK_PROBE_OUT set and the probe on PYTHONPATH?")
    end = lines[-1]["t"]
    start = end / 5 if from_minute is None else from_minute * 60
    warm = [r for r in lines if r["t"] >= start and r.get("calls", -1) >= 0]
    ts = [r["t"] / 60 for r in warm]
    calls = [float(r["calls"]) for r in warm]
    rate = _fit([r["t"] for r in warm], calls)
    out: dict[str, Any] = {
        "from_minute": round(start / 60, 1),
        "to_minute": round(end / 60, 1),
        "calls_fitted": int(calls[-1] - calls[0]) if calls else 0,
        "calls_per_s": round(rate, 1),
        "series": {},
    }
    for name in SERIES:
        if name not in warm[0]:
            continue
        ys = [float(r[name]) for r in warm]
        per_call = _fit(calls, ys)
        out["series"][name] = {
            "start_mb": round(ys[0] / 1e6, 1),
            "end_mb": round(ys[-1] / 1e6, 1),
            "mib_per_min": round(_fit(ts, ys) / 2**20, 2),
            "bytes_per_call": round(per_call, 1),
            "mib_per_min_at_full_rate": round(per_call * FULL_RATE * 60 / 2**20, 2),
        }
    return out


def _print(summary: dict[str, Any]) -> None:
    print(
        f"fitted minutes {summary['from_minute']}-{summary['to_minute']}: "
        f"{summary['calls_fitted']} calls, {summary['calls_per_s']} calls/s"
    )
    print(f"{'series':16} {'start MB':>9} {'end MB':>8} {'MiB/min':>8} {'B/call':>7} {'@167/s':>7}")
    for name, s in summary["series"].items():
        print(
            f"{name:16} {s['start_mb']:9.1f} {s['end_mb']:8.1f} {s['mib_per_min']:8.2f} "
            f"{s['bytes_per_call']:7.1f} {s['mib_per_min_at_full_rate']:7.2f}"
        )


def _load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--store", choices=["parquet", "sqlite"], default="parquet")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-rss-slope", type=float, default=0.5, help="MiB/min; fail above")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--from-minute", type=float, default=None)
    parser.add_argument("--summarize", type=Path, default=None, help="a probe.jsonl to summarize")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.summarize is not None:
        summary = summarize(_load(args.summarize), args.from_minute)
        print(json.dumps(summary)) if args.json else _print(summary)
        return 0
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench-soak-memory-"))
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / "probe"
    env = {
        **os.environ,
        "SOAK_PROBE_OUT": str(probe),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT / "bench" / "soak_probe"), os.environ.get("PYTHONPATH")) if p
        ),
    }
    load_start = os.getloadavg()
    command = [
        sys.executable,
        "-m",
        "scripts.soak",
        "--store",
        args.store,
        "--minutes",
        str(args.minutes),
        "--concurrency",
        str(args.concurrency),
        "--max-rss-slope",
        str(args.max_rss_slope),
        "--dir",
        str(folder / "store"),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    load_end = os.getloadavg()
    (folder / "soak.jsonl").write_text(done.stdout)
    report = json.loads(done.stdout.strip().splitlines()[-1])["report"] if done.stdout else {}
    summary = summarize(_load(probe / "probe.jsonl"), args.from_minute)
    result = {
        "folder": str(folder),
        "load_average_start": [round(x, 1) for x in load_start],
        "load_average_end": [round(x, 1) for x in load_end],
        "soak": {k: v for k, v in report.items() if k != "samples"},
        "probe": summary,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result["soak"]))
        print(f"load average {result['load_average_start']} -> {result['load_average_end']}")
        _print(summary)
        print(f"folder: {folder}")
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
