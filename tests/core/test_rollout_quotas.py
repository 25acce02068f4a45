"""Per-rollout quotas (issue 19, "one sandbox can fill the store"): calls and bytes.

A rollout past ``--max-rollout-calls`` or ``--max-rollout-bytes`` gets 429 naming the quota and
the setting, recorded as ``rejected``; its usage is derived from the store after a restart (never
reset), and shows in the manifest and ``/metrics``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from capture_proxy.core.rollouts import record_bytes, request_identity, request_key
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user

TOKEN = "admin-token-for-quota-tests-01"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


async def manifest(p: Proxy, rollout: str = "r1") -> dict[str, Any]:
    resp = await p.client.get(f"/admin/rollouts/{rollout}/manifest", headers=ADMIN)
    assert resp.status == 200
    data: dict[str, Any] = await resp.json()
    return data


async def test_the_call_quota_refuses_with_429_and_survives_a_restart(tmp_path: Path) -> None:
    settings: dict[str, Any] = {"admin_token": TOKEN, "max_rollout_calls": 3}
    p = await start_proxy(tmp_path, **settings)
    try:
        for i in range(3):
            assert (await p.chat(chat_body(user(f"x{i}")))).status == 200
        refused = await p.chat(chat_body(user("one too many")))
        assert refused.status == 429
        error = (await refused.json())["error"]
        assert error["code"] == "rollout_call_quota"
        assert "--max-rollout-calls" in error["message"]
        assert refused.headers["X-Capture-Status"] == "rejected"
        m = await manifest(p)
        assert m["usage"]["calls"] == 3
        assert m["limits"] == {"calls": 3, "bytes": 2**30}
        metrics = await (await p.client.get("/metrics")).text()
        assert "rollout_call_quota" in metrics
        assert "rollout_calls_used_max 3" in metrics.replace(".0", "")
    finally:
        await stop_proxy(p)
    # A new process on the same store: the quota is still spent.
    p = await start_proxy(tmp_path, **settings)
    try:
        again = await p.chat(chat_body(user("after the restart")))
        assert again.status == 429
        assert (await manifest(p))["usage"]["calls"] == 3
        assert len(p.calls()) == 3
        assert [f.reason for f in p.failures()] == ["rollout_call_quota"] * 2
        other = await p.chat(chat_body(user("another rollout")), rollout="r2")
        assert other.status == 200
    finally:
        await stop_proxy(p)


async def test_the_byte_quota_counts_what_was_staged_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    settings: dict[str, Any] = {"admin_token": TOKEN, "max_rollout_bytes": 100_000}
    p = await start_proxy(tmp_path, **settings)
    try:
        big = "y" * 6_000
        statuses = [(await p.chat(chat_body(user(f"{i}{big}")))).status for i in range(5)]
        assert statuses[:2] == [200, 200]
        assert 429 in statuses
        sizes = [record_bytes(r) for r in p.calls()]
        used = sum(sizes)
        m = await manifest(p)
        assert m["usage"]["bytes"] == used
        assert m["usage"]["bytes_in_flight"] == 0
        # The answer's size is known only once it is in: the last call admitted may pass the
        # quota, by at most its own record.
        assert used - max(sizes) < 100_000
        refused = await p.chat(chat_body(user(big)))
        error = (await refused.json())["error"]
        assert (refused.status, error["code"]) == (429, "rollout_byte_quota")
        assert "--max-rollout-bytes" in error["message"]
    finally:
        await stop_proxy(p)
    p = await start_proxy(tmp_path, **settings)
    try:
        assert (await p.chat(chat_body(user(big)))).status == 429
        assert (await manifest(p))["usage"]["bytes"] == used  # derived from the store
        small = await p.chat(chat_body(user("a small one still fits")))
        assert small.status == 200
    finally:
        await stop_proxy(p)


def test_admission_sizes_the_request_as_the_quota_counts_it_from_the_store() -> None:
    """Admission takes the request's JSON size from the encoding that keys it (sorted keys),
    which must equal the size a restart counts from the stored request (its own key order)."""
    request = {"z": [1, {"b": "é", "a": None}], "messages": [{"role": "user", "content": "x✓"}]}
    key, size = request_identity(request)
    assert key == request_key(request)
    assert size == len(orjson.dumps(request))


@pytest.mark.parametrize("setting", ["max_rollout_calls", "max_rollout_bytes"])
async def test_zero_means_no_quota(make_proxy: Any, setting: str) -> None:
    p = await make_proxy(admin_token=TOKEN, **{setting: 0})
    for i in range(3):
        assert (await p.chat(chat_body(user(f"x{i}")))).status == 200
    limits = (await manifest(p))["limits"]
    assert limits[setting.removeprefix("max_rollout_")] is None


async def test_refused_calls_cannot_fill_the_ledger_without_end(tmp_path: Path) -> None:
    # Issue 27: 16,000 refused bodies wrote 16,003 ledger rows (12.5 MB) while `calls` stayed 0.
    # A rollout's refusals are bounded by the same quota; past it, 429 counted, not written.
    settings: dict[str, Any] = {"admin_token": TOKEN, "max_rollout_calls": 3}
    bad = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}
    p = await start_proxy(tmp_path, **settings)
    try:
        statuses = [(await p.chat(bad)).status for _ in range(5)]
        assert statuses == [422, 422, 422, 429, 429]
        last = await p.chat(bad)
        error = (await last.json())["error"]
        assert error["code"] == "rollout_call_quota"
        assert "--max-rollout-calls" in error["message"]
        assert "further refusals are not recorded one by one" in error["message"]
        assert [f.http_status for f in p.failures()] == [422, 422, 422]
        metrics = await (await p.client.get("/metrics")).text()
        assert 'reason="rollout_call_quota"' in metrics
        # Its admitted calls have their own allowance still.
        assert (await p.chat(chat_body(user("a good one")))).status == 200
    finally:
        await stop_proxy(p)
    p = await start_proxy(tmp_path, **settings)  # a restart does not reset the count
    try:
        assert (await p.chat(bad)).status == 429
        assert len(p.failures()) == 3
    finally:
        await stop_proxy(p)
