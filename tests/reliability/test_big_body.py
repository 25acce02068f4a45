"""Large hostile requests do not take the proxy down (a real ``capture-proxy serve`` process).

While ~16 MiB bodies of millions of empty objects (in ``chat_template_kwargs``, a tool's
``parameters``, or ``messages`` itself, three of those at once) are sent, another client's small
calls keep succeeding without a long stall, the proxy's peak memory stays proportional to the
bodies, and each hostile call gets its 413 naming the setting, in the ledger. Bounds are generous
(the machine is shared); the figures themselves are measured by ``bench/bench_big_body.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from capture_proxy.read.reader import open_store
from tests.support.reliability_workers import start_proxy

_SMALL = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_BODY_MIB = 16


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise ProcessLookupError(pid)


def _hostile(where: str) -> bytes:
    filler = b"[" + b"{}," * (_BODY_MIB * 2**20 // 3) + b"0]"
    if where == "messages":
        return b'{"model":"policy","messages":[' + b"{}," * (_BODY_MIB * 2**20 // 3) + b"{}]}"
    head = b'{"model":"policy","messages":[{"role":"user","content":"hi"}],'
    if where == "chat_template_kwargs":
        return head + b'"chat_template_kwargs":{"x":' + filler + b"}}"
    tool = b'{"type":"function","function":{"name":"f","parameters":{"type":"object","x":'
    return head + b'"tools":[' + tool + filler + b"}}}]}"


async def _small_calls(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, latencies: list[float]
) -> None:
    for _ in range(5000):  # bounded; ends when the hostile call is answered
        if stop.is_set():
            return
        t = time.perf_counter()
        async with session.post(url, json=_SMALL) as resp:
            await resp.read()
            assert resp.status == 200, resp.status
            assert resp.headers["X-Capture-Status"] == "staged"
        latencies.append(time.perf_counter() - t)


async def _big_call(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())["error"]


@pytest.mark.parametrize(
    ("where", "at_once"),
    [("chat_template_kwargs", 1), ("tool_parameters", 1), ("messages", 3)],
)
async def test_a_large_hostile_body_leaves_other_calls_served_and_memory_bounded(
    tmp_path: Path, where: str, at_once: int
) -> None:
    body = _hostile(where)
    store = f"sqlite:///{tmp_path / 'store.db'}"
    proxy = start_proxy("fake", store)
    try:
        base = proxy.wait_ready()
        latencies: list[float] = []
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            stop = asyncio.Event()
            small = asyncio.create_task(
                _small_calls(session, f"{base}/r/small/v1/chat/completions", stop, latencies)
            )
            await asyncio.sleep(0.5)
            url = f"{base}/r/big/v1/chat/completions"
            answers = await asyncio.gather(*(_big_call(session, url, body) for _ in range(at_once)))
            await asyncio.sleep(0.3)
            stop.set()
            await small
        peak = _peak_rss_mb(proxy.pid)
    finally:
        proxy.terminate()
    for status, err in answers:
        # Refused from a count of the raw body, before a value of it was decoded.
        assert status == 413
        assert (err["code"], err["param"]) == ("json_too_many_items", "")
        assert "--max-json-items" in err["message"]
    assert len(latencies) >= 5
    assert max(latencies) < 2.0, f"worst small-call latency {max(latencies):.2f}s"
    body_mb = at_once * len(body) / 2**20
    assert peak < 300 + 4 * body_mb, f"peak RSS {peak:.0f} MB for {body_mb:.0f} MiB of bodies"
    with open_store(store) as reader:
        entries = reader.failures("big")
        assert [(e.status, e.reason, e.http_status) for e in entries] == [
            ("rejected", "json_too_many_items", 413)
        ] * at_once
        assert len(reader.calls("small", include_open=True, include_poisoned=True)) == len(
            latencies
        )
