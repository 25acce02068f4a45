"""The weight version belongs to the store: several proxies on one dataset (moto's S3 server)
stamp the version any of them set last, learnt within ``--weight-version-refresh`` seconds and
at every pause and resume answer; a proxy restarted on the dataset stamps its latest."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from capture_proxy.sinks.registry import open_sink, open_source
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user
from tests.support.s3 import MotoS3

ADMIN = {"Authorization": "Bearer admin-token"}
#: The bound the proxies here are given (``--weight-version-refresh``).
REFRESH_S = 0.5


async def _proxy(tmp_path: Path, name: str, url: str) -> Proxy:
    return await start_proxy(
        tmp_path / name,
        sink=open_sink(url),
        store=url,
        admin_token="admin-token",
        weight_version_refresh=REFRESH_S,
    )


async def _stamped(proxy: Proxy, rollout: str) -> int:
    """The weight version the store holds on a call just staged through `proxy`."""
    resp = await proxy.chat(chat_body(user("x")), rollout=rollout)
    assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
    source = open_source(proxy.state.settings.store)
    try:
        return source.calls(rollout)[-1].weight_version
    finally:
        source.close_reader()


async def _resume(proxy: Proxy, version: int | None = None) -> int:
    body = {} if version is None else {"weight_version": version}
    resp = await proxy.client.post("/admin/weights/resume", json=body, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    answer: int = (await resp.json())["weight_version"]
    return answer


async def test_a_version_set_on_one_proxy_is_stamped_by_the_others_within_the_bound(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    url = moto_s3.url()
    a = await _proxy(tmp_path, "a", url)
    b = await _proxy(tmp_path, "b", url)
    try:
        assert await _resume(a, 5) == 5
        set_at = time.monotonic()
        while await _stamped(b, "on-b") != 5:
            assert time.monotonic() - set_at < REFRESH_S + 5, "b never stamped a's version"
            await asyncio.sleep(0.1)
        # b's own pause and resume answer with the store's version at once, then sets another.
        assert await _resume(b) == 5
        assert await _resume(b, 6) == 6
        # a learns 6 at its next resume answer, without waiting for the bound.
        assert await _resume(a) == 6
        assert await _stamped(a, "on-a") == 6
        # Back and forth: the store's latest wins wherever it was set (7 on a, then 3 on b: a
        # rollback to a checkpoint is a version too).
        assert await _resume(a, 7) == 7
        assert await _resume(b) == 7
        assert await _resume(b, 3) == 3
        assert await _resume(a) == 3
    finally:
        await stop_proxy(a)
        await stop_proxy(b)
    # A proxy restarted on the dataset stamps its latest version (3, set through b).
    again = await _proxy(tmp_path, "a-again", url)
    try:
        assert await _stamped(again, "after-restart") == 3
    finally:
        await stop_proxy(again)


def _lists(moto: MotoS3) -> int:
    """LIST requests (ListObjectsV2) moto has answered so far."""
    time.sleep(0.15)  # its log line follows the response
    return moto.log_path.read_text(errors="replace").count("list-type=2")


async def test_a_restarted_proxy_takes_up_the_version_from_its_stores_open_listing(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    url = moto_s3.url()
    first = await start_proxy(tmp_path / "first", sink=open_sink(url), store=url)
    try:
        await first.state.capture.set_weight_version(4)
    finally:
        await stop_proxy(first)
    # On a large dataset each listing of the commit markers is a request per thousand units,
    # seconds in all: the restarted proxy reads its version with the listing its store's open
    # took, not another one.
    before = _lists(moto_s3)
    sink = open_sink(url)
    opened = _lists(moto_s3)
    assert opened > before
    again = await start_proxy(tmp_path / "again", sink=sink, store=url, weight_version_refresh=60)
    try:
        assert _lists(moto_s3) == opened
        assert again.state.capture.weight_version == 4
        assert await _stamped(again, "after-restart") == 4
    finally:
        await stop_proxy(again)
