"""Setting the weight version: stored, stamped on later calls, pushed to the engine(s).

The one setter behind ``PUT /admin/weight-version``, ``POST /admin/weights/resume`` with a
version, and `CaptureClient.set_weight_version` (docs/contract.md): the store is the record's
truth, so the version is stored and stamped first, then pushed to vLLM's
``/update_weight_version``. A push that fails is reported and logged, never undoes the version.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

from ..core.capture import Capture
from ..errors import UpstreamFailed
from .replicas import ReplicaSet

__all__ = ["fleet_answer", "set_weight_version"]

log = logging.getLogger(__name__)


@runtime_checkable
class _PushesWeightVersion(Protocol):
    async def push_weight_version(self, version: int) -> bool: ...


async def set_weight_version(capture: Capture, upstream: object, version: int) -> dict[str, Any]:
    """Store `version` and stamp it on later calls (`Capture.set_weight_version`), then push it
    to the upstream's ``/update_weight_version`` when served (every healthy replica's, with
    several: ``engine_replicas`` gives each one's result, and the version becomes the fleet's
    engine weight version: `ReplicaSet.push_weight_version`).

    Returns the control API's answer: ``{"weight_version", "engine": "updated" | "not_served" |
    "failed", "engine_error"?, "engine_replicas"?}``; ``not_served`` too for an upstream that
    has no such route (a transport of the caller's own, or none). Raises what
    `Capture.set_weight_version` raises (422 for a bad version, 503 when the store cannot take
    it): then nothing was pushed.
    """
    await capture.set_weight_version(version)
    if isinstance(upstream, ReplicaSet):
        results = await upstream.push_weight_version(version)
        return {"weight_version": version, **fleet_answer("engine", results, "updated")}
    if not isinstance(upstream, _PushesWeightVersion):
        return {"weight_version": version, "engine": "not_served"}
    try:
        engine = "updated" if await upstream.push_weight_version(version) else "not_served"
    except UpstreamFailed as e:
        log.warning("weight version %d stored, but not pushed to the upstream: %s", version, e)
        return {"weight_version": version, "engine": "failed", "engine_error": e.message}
    return {"weight_version": version, "engine": engine}


def fleet_answer(key: str, results: dict[str, str], done: str) -> dict[str, Any]:
    """The answer of an engine route sent to every replica: ``failed`` when any failed (named
    in ``<key>_error``) or none was healthy to try, else `done` when any did it, else
    ``not_served``; ``<key>_replicas`` holds each replica's own result."""
    failed = {name: r for name, r in results.items() if r.startswith("failed")}
    if all(r.startswith("skipped") for r in results.values()):
        answer: dict[str, Any] = {
            key: "failed",
            f"{key}_error": "no healthy replica to reach: "
            + "; ".join(f"{name}: {r}" for name, r in results.items()),
        }
    elif failed:
        answer = {
            key: "failed",
            f"{key}_error": "; ".join(f"{name}: {r}" for name, r in failed.items()),
        }
    elif any(r == done for r in results.values()):
        answer = {key: done}
    else:
        answer = {key: "not_served"}
    return {**answer, f"{key}_replicas": results}
