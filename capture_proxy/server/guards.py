"""The proxy's background guards, while it serves: the free-disk floor, the sink's own problem
and a probe write while it fails, ledger entries held in memory, idle rollouts, and the weight
version other proxies on the store set."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil

from ..sinks.registry import store_local_dir
from .state import ProxyState

log = logging.getLogger("capture_proxy")


def _disk_problem(folder: str, floor: int) -> str | None:
    """Why the store's disk is below the floor, or None. Blocking: run it on a thread."""
    probe = folder
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe).free
    except OSError as e:
        return f"cannot read free disk at {probe}: {e}"
    if free < floor:
        mib = 2**20
        return f"free disk at the store ({free // mib} MiB) is below the floor ({floor // mib} MiB)"
    return None


async def run_guards(state: ProxyState, store_url: str) -> None:
    """Once a second: the free-disk floor, the sink's own problem (a SQLite file deleted or
    replaced under it), a probe write while the sink is failing, ledger entries the sink
    refused, idle rollouts."""
    floor = state.settings.min_free_disk_mb * 2**20
    folder = store_local_dir(store_url)  # the store kind's local folder; None: not on a disk
    # Optional on sinks, like `stats`: blocking (a stat), so asked from a thread.
    sink_problem = getattr(state.sink, "problem", None)
    while True:
        if floor and folder:
            state.capture.unavailable_reason = await asyncio.to_thread(_disk_problem, folder, floor)
        problem = await asyncio.to_thread(sink_problem) if callable(sink_problem) else None
        if problem:
            # The sink-failure path: /readyz fails naming it, writes already fail with it.
            state.capture.stager.sink_failing = problem
        elif state.capture.stager.sink_failing:
            await _probe_sink(state)
        if state.capture.ledger.held:
            await state.capture.ledger.flush()
        state.pipeline.forget_rollouts(
            state.capture.evict_idle(state.settings.rollout_idle_timeout)
        )
        await asyncio.sleep(1.0)


async def follow_weight_version(state: ProxyState) -> None:
    """Every ``--weight-version-refresh`` seconds, the weight version the store last recorded:
    several proxies on one store stamp the version any of them set, within that bound."""
    while True:
        await asyncio.sleep(state.settings.weight_version_refresh)
        await state.capture.refresh_weight_version()


async def _probe_sink(state: ProxyState) -> None:
    """Clear the sink's failure once a probe write succeeds (optional on sinks, like `stats`).

    Without it, readiness failed by a full disk came back only when a call staged: behind a
    Kubernetes Service that had taken the pod out of rotation, no call ever came."""
    probe = getattr(state.sink, "probe", None)
    if not callable(probe):
        return
    try:
        async with asyncio.timeout(state.settings.stage_timeout):
            await probe()
    except Exception as e:  # still failing: say the newest reason
        state.capture.stager.sink_failing = f"{type(e).__name__}: {e}"
        return
    log.info("the store takes writes again (a probe write succeeded): ready to capture")
    state.capture.stager.sink_failing = None
