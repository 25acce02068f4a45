"""A real ``capture-proxy serve`` process, SIGKILLed under load and restarted on the same store; and
a short soak of one. These are the CI variants of ``scripts/crash_loop.py`` (docs/contract.md,
"Failure semantics": nothing acknowledged is lost, nothing is torn, restarts need no manual step)
and ``scripts/soak.py`` (memory, descriptors and staged counts after steady load);
docs/reports/reliability.md has the long runs.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from capture_proxy.read.reader import open_store
from scripts import crash_loop, soak
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user


# slow: real processes under load, ~25 s per sink. The checks of the checks below stay fast.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_sigkill_under_load_loses_nothing_acknowledged(kind: str, tmp_path: Path) -> None:
    # check_store runs after every round and raises Violation if an acknowledged call is missing,
    # in another rollout, or fails its digest, if verify() finds a torn record or an attachment
    # without its record, or if a rollout holds one seq twice.
    rounds = await crash_loop.crash_loop(
        kind, tmp_path, rounds=4, seed=1129, concurrency=12, kill_after=(0.4, 1.5)
    )
    kills = [r for r in rounds if r.exit == "SIGKILL"]
    assert len(kills) == 4
    assert rounds[-1].exit == "SIGTERM rc=0"
    # Every restart on the killed store served and staged again with no manual step ...
    assert all(r.acked > 0 for r in rounds)
    # ... and picked up the sessions the killed process left half-way (logged as it does so).
    assert all(r.resumed > 0 for r in rounds[1:])
    assert rounds[-1].records >= rounds[-1].acked_total >= len(rounds)


def test_store_check_catches_a_lost_acknowledged_call(tmp_path: Path) -> None:
    """The crash loop's check is not vacuous: an acknowledged id missing from the store fails it,
    and so does a call filed under another rollout."""
    rounds = asyncio.run(
        crash_loop.crash_loop("sqlite", tmp_path, rounds=0, concurrency=4, kill_after=(0.5, 0.6))
    )
    assert rounds[0].acked > 0
    url = crash_loop.store_url("sqlite", tmp_path)
    with open_store(url) as store:
        rollout = store.rollouts()[0]
        real = store.calls(rollout, include_open=True, include_poisoned=True)[0].call_id
    with pytest.raises(crash_loop.Violation, match="missing"):
        crash_loop.check_store(url, {real: rollout, "01JZZZZZZZZZZZZZZZZZZZZZZZ": rollout})
    with pytest.raises(crash_loop.Violation, match="not its rollout"):
        crash_loop.check_store(url, {real: "another-rollout"})


@pytest.mark.slow  # 12 s of load per sink
@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_short_soak_keeps_counts_memory_and_descriptors(kind: str, tmp_path: Path) -> None:
    report = await soak.soak(kind, tmp_path, minutes=0.2, concurrency=32, sample_every=2.0)
    assert report.problems == []
    assert report.outcomes == {"staged": report.calls}
    # Every acknowledged call is in the store, and the store holds exactly what was counted.
    assert report.acked == report.calls
    assert report.records_in_store == report.staged_metric >= report.acked
    assert report.verified_sample == min(500, report.acked)
    assert report.fds_end <= report.fds_start + 32 + 16
    assert report.rss_max_mb < 1024


def test_rss_slope_is_a_least_squares_fit() -> None:
    assert soak.slope_per_minute([(0, 100.0), (60, 101.0), (120, 102.0)]) == pytest.approx(1.0)
    assert soak.slope_per_minute([(0, 5.0), (30, 5.0)]) == 0.0
    assert soak.slope_per_minute([(0, 5.0)]) == 0.0


async def test_sealed_rollouts_do_not_stay_in_memory(tmp_path: Path) -> None:
    p = await start_proxy(tmp_path, admin_token="t", min_free_disk_mb=0)
    admin = {"Authorization": "Bearer t"}
    try:
        for i in range(20):
            for turn in range(2):
                resp = await p.chat(chat_body(user(f"session {i} turn {turn}")), rollout=f"s{i}")
                assert resp.headers["X-Capture-Status"] == "staged"
            assert (await p.client.post(f"/admin/rollouts/s{i}/seal", headers=admin)).status == 200
        # Sealed rollouts are still refused and still have manifests (from the store) ...
        late = await p.chat(chat_body(user("late")), rollout="s0")
        assert late.status == 409
        manifest = await (await p.client.get("/admin/rollouts/s3/manifest", headers=admin)).json()
        assert [c["status"] for c in manifest["calls"]] == ["staged", "staged"]
        # ... but the proxy no longer holds them.
        text = await (await p.client.get("/metrics")).text()
        live = re.search(r"^capture_proxy_rollouts_live (\S+)$", text, re.M)
        assert live is not None
        assert float(live.group(1)) == 0, f"{live.group(1)} rollouts still held"
    finally:
        await stop_proxy(p)


def _tree_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _bytes_read() -> int:
    """Bytes this process has read through read()/pread() so far (Linux /proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_new_rollout_does_not_read_the_whole_store(kind: str, tmp_path: Path) -> None:
    """Each new rollout id is looked up in the store (it may be one an earlier process staged
    into); that lookup must not cost a read of the whole store. (It did for Parquet, where each
    lookup opened a fresh reader that indexed every unit: the first 10-minute soak fell to
    2.5 calls/s with a 115 s p99.)"""
    from capture_proxy.sinks.registry import open_sink

    url = f"sqlite:///{tmp_path / 'store.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/ds"
    sink = open_sink(url)
    p = await start_proxy(tmp_path, sink=sink, store=url, min_free_disk_mb=0)
    try:
        for i in range(60):  # a store of many sessions (and, for Parquet, many units)
            staged = await p.chat(chat_body(user(f"session {i}"), max_tokens=8), rollout=f"old{i}")
            assert staged.headers["X-Capture-Status"] == "staged"
        size = await asyncio.to_thread(_tree_size, tmp_path)
        before = _bytes_read()
        resp = await p.chat(chat_body(user("a new session"), max_tokens=8), rollout="new")
        read = _bytes_read() - before
        assert resp.headers["X-Capture-Status"] == "staged"
        assert read < size / 4, f"a new rollout read {read} bytes of a {size}-byte store"
    finally:
        await stop_proxy(p)
