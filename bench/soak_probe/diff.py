"""Diff two tracemalloc snapshots of `bench/soak_probe` by file and line, per call.

    python bench/soak_probe/diff.py OLD.pickle NEW.pickle [--top 25]

The snapshot names carry the calls the store held (``snap-<seconds>-<calls>.pickle``); the diff
is printed in bytes and in bytes per call between the two.
"""

from __future__ import annotations

import argparse
import tracemalloc
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--key", default="lineno", choices=["lineno", "filename", "traceback"])
    args = parser.parse_args()
    calls = int(args.new.stem.split("-")[2]) - int(args.old.stem.split("-")[2])
    old = tracemalloc.Snapshot.load(str(args.old))
    new = tracemalloc.Snapshot.load(str(args.new))
    stats = new.compare_to(old, args.key)
    total = sum(s.size_diff for s in stats)
    print(f"{calls} calls; traced growth {total / 1e6:.2f} MB, {total / max(calls, 1):.0f} B/call")
    for s in stats[: args.top]:
        where = s.traceback.format()[-1].strip() if args.key != "traceback" else str(s.traceback)
        print(
            f"{s.size_diff / 1e3:10.1f} kB {s.size_diff / max(calls, 1):7.1f} B/call "
            f"{s.count_diff:+8d}  {where}"
        )
        if args.key == "traceback":
            for line in s.traceback.format()[:-1]:
                print("            ", line)


if __name__ == "__main__":
    main()
