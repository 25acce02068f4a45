"""`ReplicaSet.route` before any probe: nothing is placed on a replica not known to be healthy,
and a pinned rollout is never moved away from a replica only because it was not probed yet."""

from __future__ import annotations

import pytest

from capture_proxy.errors import UpstreamFailed
from capture_proxy.upstream import HTTPUpstream, ReplicaSet

A, B = "http://127.0.0.1:9/v1", "http://127.0.0.1:10/"


@pytest.mark.parametrize("move", [False, True])
async def test_before_the_first_probe_calls_get_503_and_no_rollout_moves(move: bool) -> None:
    replicas = ReplicaSet([A, B], HTTPUpstream, move=move, probe_interval=2.5)
    try:
        assert [r.name for r in replicas.replicas] == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
        with pytest.raises(UpstreamFailed) as pinned:
            replicas.route("r1", "http://127.0.0.1:9", dict)
        assert pinned.value.status == 503
        assert pinned.value.code == "upstream_unavailable"
        assert pinned.value.headers["Retry-After"] == "3"
        assert "pinned to replica http://127.0.0.1:9, not probed yet" in pinned.value.message
        with pytest.raises(UpstreamFailed) as new:
            replicas.route("r2", "", dict)
        assert new.value.message == (
            "no healthy upstream replica: http://127.0.0.1:9 starting (not probed yet); "
            "http://127.0.0.1:10 starting (not probed yet)"
        )
    finally:
        await replicas.close()
