"""Make a local Parquet dataset look older: what an hour or a day of waiting would do.

gc's window rule (docs/storage.md) goes by each unit's commit time, which is in the unit's name
(``<order>-<id>``, nanoseconds). `age_units` renames every unit (its marker, data files, the
names other markers retire) as if committed `seconds` earlier, keeping their order. Run it with
no writer open on the dataset (a writer's next unit must still come after the aged ones: it
does, since it takes the current time).
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson

__all__ = ["age_units"]


def _aged(unit: str, by_ns: int) -> str:
    order, rest = unit.split("-", 1)
    return f"{int(order) - by_ns:020d}-{rest}"


def age_units(ds: Path, seconds: float) -> None:
    """Rename every unit of the dataset at `ds` as if committed `seconds` earlier."""
    by_ns = int(seconds * 1e9)
    for marker in sorted((ds / "_commits").glob("*.json")):
        d = orjson.loads(marker.read_bytes())
        unit = d["unit"]
        new = _aged(unit, by_ns)
        files = {}
        for table, rel in d["files"].items():
            new_rel = rel.replace(unit, new)
            if (ds / rel).exists():
                os.replace(ds / rel, ds / new_rel)
            files[table] = new_rel
        d.update(
            unit=new,
            files=files,
            retires=[_aged(u, by_ns) for u in d.get("retires", [])],
            created_at_ms=int(d.get("created_at_ms", 0)) - int(seconds * 1000),
        )
        (ds / "_commits" / f"{new}.json").write_bytes(orjson.dumps(d))
        marker.unlink()
