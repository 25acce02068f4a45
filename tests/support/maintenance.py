"""What the Parquet maintenance tests run on a dataset and read back from it.

`compact_all` merges every unit into one (no shared window keeping young merged units apart), and
`snapshot` is what a reader sees of every rollout: a maintenance run, finished, fenced or
killed, must leave the snapshot as it found it.
"""

from __future__ import annotations

from capture_proxy.read.reader import open_store
from capture_proxy.sinks.base import CompactStats, Progress
from capture_proxy.sinks.parquet._compact import compact_dataset

__all__ = ["compact_all", "snapshot"]


def compact_all(
    url: str, *, grace_s: float = 600, progress: Progress | None = None
) -> CompactStats:
    """Compact the dataset at `url` into one unit (merged units too), with a grace of `grace_s`
    seconds before retired units are deleted."""
    return compact_dataset(
        url, target_bytes=1 << 30, grace_s=grace_s, shared_window_s=0, progress=progress
    )


def snapshot(url: str) -> dict[str, list[tuple[str, str]]]:
    """Every rollout's calls (id, digest) and its events' hashes, as a reader sees them."""
    with open_store(url) as store:
        out = {}
        for r in store.rollouts():
            calls = [(c.call_id, c.digest) for c in store.source.calls(r)]
            events = [("event", e.hash) for e in store.source.events(r)]
            out[r] = calls + events
        return out
