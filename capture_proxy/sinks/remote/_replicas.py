"""What a running proxy says of its upstream replicas, at ``GET /admin/store/replicas``."""

from __future__ import annotations

import msgspec

__all__ = ["ReplicaStatus"]


class ReplicaStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One upstream replica of a proxy, as its last probe left it (docs/fleets.md).

    `state` is ``starting``, ``healthy``, ``unreachable``, ``down``, ``missing_route``,
    ``wrong_model``, ``quarantined``, ``stale_weights`` or ``held``; `problem` says why it is not
    healthy ("" when it is); `live_rollouts` counts the rollouts in the proxy's memory pinned to
    it (the load new rollouts are placed by). `engine_weight_version` is its engine's weight
    version (None: not reported). `probed_at_ms` is 0 until a probe answered.
    """

    replica: str
    state: str
    problem: str = ""
    version: str = ""
    fingerprint: str = ""
    model: str = ""
    engine_weight_version: str | None = None
    probed_at_ms: int = 0
    live_rollouts: int = 0
