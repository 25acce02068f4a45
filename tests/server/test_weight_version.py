"""The driver's weight version survives a proxy restart, and a rollout that goes back is flagged.

Both store kinds: the version is kept in the store (the proxy-state rollout header), restored
when a proxy starts on it, and a call stamped lower than its rollout's previous call is staged
with ``weight_version_decreased_from`` in its record's extras and its manifest line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import RolloutInfo, StagedCallRecord
from capture_proxy.sinks.base import PROXY_STATE_ROLLOUT, StoreError
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.registry import open_sink, open_source
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _url(kind: str, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/ds"


async def _proxy(tmp_path: Path, url: str) -> Proxy:
    return await start_proxy(tmp_path, sink=open_sink(url), admin_token=TOKEN)


async def _set(p: Proxy, version: int) -> None:
    resp = await p.client.put(
        "/admin/weight-version", json={"weight_version": version}, headers=ADMIN
    )
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["weight_version"] == version


async def _call(p: Proxy, history: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    messages = [*history, user(text)]
    resp = await p.chat(chat_body(*messages), rollout="ep")
    assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
    answer = (await resp.json())["choices"][0]["message"]
    return [*messages, {"role": "assistant", "content": answer["content"]}]


def _calls(url: str) -> list[StagedCallRecord]:
    src = open_source(url)
    try:
        return src.calls("ep")
    finally:
        src.close_reader()


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_weight_version_survives_a_restart_and_a_decrease_is_flagged(
    tmp_path: Path, kind: str
) -> None:
    url = _url(kind, tmp_path)
    first = await _proxy(tmp_path, url)
    await _set(first, 5)
    history = await _call(first, [], "hello")
    await stop_proxy(first)

    second = await _proxy(tmp_path, url)
    try:
        history = await _call(second, history, "go on")
        assert [r.weight_version for r in _calls(url)] == [5, 5]
        await _set(second, 3)  # a rollback to an earlier checkpoint: legitimate
        history = await _call(second, history, "and then?")
        await _call(second, history, "more")
        records = _calls(url)
        assert [r.weight_version for r in records] == [5, 5, 3, 3]
        # Only the call where the version went down is flagged, in its digest-covered extras.
        assert [r.extras.get("weight_version_decreased_from") for r in records] == [
            None,
            None,
            5,
            None,
        ]
        manifest = await second.client.get("/admin/rollouts/ep/manifest", headers=ADMIN)
        lines = (await manifest.json())["calls"]
        assert [c.get("weight_version_decreased_from") for c in lines] == [None, None, 5, None]
    finally:
        await stop_proxy(second)

    # A manifest rebuilt from the store says the same, and the store still verifies.
    third = await _proxy(tmp_path, url)
    try:
        manifest = await third.client.get("/admin/rollouts/ep/manifest", headers=ADMIN)
        lines = (await manifest.json())["calls"]
        assert [c.get("weight_version_decreased_from") for c in lines] == [None, None, 5, None]
        assert third.state.capture.weight_version == 3
    finally:
        await stop_proxy(third)
    store = open_store(url)
    try:
        store.verify()
        assert store.rollouts() == ["ep"]  # the proxy's own state is not a rollout
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_version_set_before_any_call_survives_a_restart(tmp_path: Path, kind: str) -> None:
    url = _url(kind, tmp_path)
    first = await _proxy(tmp_path, url)
    await _set(first, 7)
    await stop_proxy(first)
    second = await _proxy(tmp_path, url)
    try:
        await _call(second, [], "hello")
        assert [r.weight_version for r in _calls(url)] == [7]
    finally:
        await stop_proxy(second)


class _HeaderDown(MemorySink):
    """A store that refuses rollout headers (and so the weight version)."""

    async def put_rollout(self, info: RolloutInfo) -> None:
        raise StoreError("the store is read-only")


async def test_a_version_the_store_cannot_keep_is_503_and_not_applied(tmp_path: Path) -> None:
    sink = _HeaderDown()
    p = await start_proxy(tmp_path, sink=sink, admin_token=TOKEN)
    try:
        resp = await p.client.put(
            "/admin/weight-version", json={"weight_version": 4}, headers=ADMIN
        )
        assert resp.status == 503
        error = (await resp.json())["error"]
        assert error["code"] == "weight_version_not_stored"
        assert "the store is read-only" in error["message"]
        assert "still stamped 0" in error["message"]
        await _call(p, [], "hello")
        assert [r.weight_version for r in sink.calls("ep")] == [0]
        assert PROXY_STATE_ROLLOUT not in sink.rollouts()
    finally:
        await stop_proxy(p)
