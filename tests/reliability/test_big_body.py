"""One large hostile request does not take the proxy down (a real ``capture-proxy serve`` process).

While a ~16 MiB body of free-form JSON (millions of empty objects, in ``chat_template_kwargs`` or
a tool's ``parameters``) is sent, another client's small calls keep succeeding without a long
stall, the proxy's peak memory stays proportional to the body, and the hostile call gets its
413 naming the value. Bounds are generous (the machine is shared); the figures themselves are
measured by ``bench/bench_big_body.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

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


@pytest.mark.parametrize(
    ("where", "param"),
    [
        ("chat_template_kwargs", "chat_template_kwargs"),
        ("tool_parameters", "tools[0].function.parameters"),
    ],
)
async def test_a_large_hostile_body_leaves_other_calls_served_and_memory_bounded(
    tmp_path: Path, where: str, param: str
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
            async with session.post(
                f"{base}/r/big/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as resp:
                status = resp.status
                err = orjson.loads(await resp.read())["error"]
            await asyncio.sleep(0.3)
            stop.set()
            await small
        peak = _peak_rss_mb(proxy.pid)
    finally:
        proxy.terminate()
    assert status == 413
    assert (err["code"], err["param"]) == ("free_json_too_large", param)
    assert "--max-free-json-bytes" in err["message"]
    assert len(latencies) >= 5
    assert max(latencies) < 2.0, f"worst small-call latency {max(latencies):.2f}s"
    body_mb = len(body) / 2**20
    assert peak < 300 + 4 * body_mb, f"peak RSS {peak:.0f} MB for a {body_mb:.0f} MiB body"
    with open_store(store) as reader:
        (entry,) = reader.failures("big")
        assert (entry.status, entry.reason, entry.http_status) == (
            "rejected",
            "free_json_too_large",
            413,
        )
        assert len(reader.calls("small", include_open=True, include_poisoned=True)) == len(
            latencies
        )
