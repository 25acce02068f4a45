"""Which anonymous mappings of the soak's proxy grew, from `bench/soak_probe`'s ``maps.jsonl``.

    python bench/soak_probe/maps.py D/probe/maps.jsonl [--from-minute 2] [--top 15]

The probe writes every anonymous mapping of the proxy once a minute (start, end, permissions,
kind, anonymous bytes). This prints, between the sample nearest `--from-minute` and the last:
the anonymous bytes of each kind and their growth per call stored; the ``other`` kind against
what the probe can name inside it (Python's object arenas, 1 MiB each, and malloc's own mmaps,
both from the matching ``probe.jsonl`` lines); the mappings that grew most (address range, size,
growth), and the sizes of the ``other`` mappings that appeared or went (1 MiB ones are Python's
arenas or malloc's blocks; 8 MiB ones with a guard page below are thread stacks).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any


def _near(lines: list[dict[str, Any]], t: float) -> dict[str, Any]:
    return min(lines, key=lambda r: abs(float(r["t"]) - t))


def _by_kind(maps: list[list[Any]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for _low, _high, _perms, kind, anon in maps:
        out[kind] += anon
    return out


def _grown(old: list[list[Any]], new: list[list[Any]]) -> list[tuple[int, list[Any], int]]:
    """Each new mapping's anonymous bytes minus those of the old mappings it overlaps."""
    out = []
    for row in new:
        low, high = row[0], row[1]
        before = sum(o[4] for o in old if o[0] < high and low < o[1])
        out.append((row[4] - before, row, before))
    return sorted(out, key=lambda x: -x[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("maps", type=Path)
    parser.add_argument("--from-minute", type=float, default=2.0)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    samples = [json.loads(x) for x in args.maps.read_text().splitlines() if x.strip()]
    probe_path = args.maps.with_name("probe.jsonl")
    probe = [json.loads(x) for x in probe_path.read_text().splitlines() if x.strip()]
    old, new = _near(samples, args.from_minute * 60), samples[-1]
    calls = max(int(new["calls"]) - int(old["calls"]), 1)
    p_old, p_new = _near(probe, float(old["t"])), _near(probe, float(new["t"]))
    print(f"t {old['t']} -> {new['t']} s, {calls} calls")
    k_old, k_new = _by_kind(old["maps"]), _by_kind(new["maps"])
    for kind in sorted(set(k_old) | set(k_new)):
        d = k_new[kind] - k_old[kind]
        before, after = k_old[kind] / 1e6, k_new[kind] / 1e6
        print(f"  {kind:7} {before:8.1f} -> {after:8.1f} MB  {d / calls:7.1f} B/call")
    for name in ("py_arenas", "mmapped", "py_used", "threads"):
        d = p_new[name] - p_old[name]
        print(f"  probe {name:10} {p_old[name]:>12} -> {p_new[name]:>12}  {d / calls:7.1f} /call")
    rest_old = k_old["other"] - p_old["py_arenas"] - p_old["mmapped"]
    rest_new = k_new["other"] - p_new["py_arenas"] - p_new["mmapped"]
    print(
        f"  other minus Python's arenas and malloc's mmaps: {rest_old / 1e6:.1f} -> "
        f"{rest_new / 1e6:.1f} MB, {(rest_new - rest_old) / calls:.1f} B/call"
    )
    print("mappings that grew most (growth, start-end, size, perms, kind, before -> after):")
    for growth, row, before in _grown(old["maps"], new["maps"])[: args.top]:
        size = (row[1] - row[0]) >> 10
        print(
            f"  {growth / 1e3:9.1f} kB  {row[0]:x}-{row[1]:x} {size:>8} KiB {row[2]} "
            f"{row[3]:6} {before / 1e3:.0f} -> {row[4] / 1e3:.0f} kB"
        )
    sizes_old = Counter((r[1] - r[0]) >> 10 for r in old["maps"] if r[3] == "other")
    sizes_new = Counter((r[1] - r[0]) >> 10 for r in new["maps"] if r[3] == "other")
    print("other mappings by size (KiB: count before -> after):")
    for size in sorted(set(sizes_old) | set(sizes_new)):
        if sizes_old[size] != sizes_new[size] or size >= 1024:
            print(f"  {size:>8} KiB: {sizes_old[size]} -> {sizes_new[size]}")


if __name__ == "__main__":
    main()
