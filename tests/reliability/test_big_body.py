"""Large hostile requests do not take the proxy down (a real ``capture-proxy serve`` process).

While ~16 MiB bodies of millions of empty objects (in ``chat_template_kwargs``, a tool's
``parameters``, or ``messages`` itself, three of those at once) are sent, another client's small
calls keep succeeding without a long stall, the proxy's peak memory stays proportional to the
bodies, and each hostile call gets its 413 naming the setting, in the ledger. Bounds are generous
(the machine is shared); the figures themselves are measured by ``bench/bench_big_body.py``.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from capture_proxy.read.reader import open_store
from tests.support.reliability_workers import start_fake, start_proxy

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


def _png_base64(side: int, seed: int) -> bytes:
    """A valid PNG of `side` x `side` noisy RGB pixels, stored (not compressed), as base64."""
    row = bytes(((x * 7 + seed) * 31) % 251 for x in range(side * 3))
    raw = b"".join(b"\x00" + row for _ in range(side))
    head = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        tagged = kind + data
        return struct.pack(">I", len(data)) + tagged + struct.pack(">I", zlib.crc32(tagged))

    png = chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw, 0)) + chunk(b"IEND", b"")
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + png)


def _image_body(mib: int) -> bytes:
    """An honest image session's body: one user message of distinct ~4 MiB images, `mib` MiB
    in all."""
    part = b'{"type":"image_url","image_url":{"url":"data:image/png;base64,%s"}},'
    one = len(part % _png_base64(1024, 0))
    parts = b"".join(part % _png_base64(1024, seed) for seed in range(max(1, mib * 2**20 // one)))
    return (
        b'{"model":"policy","max_tokens":4,"messages":[{"role":"user","content":['
        + parts
        + b'{"type":"text","text":"what is in these?"}]}]}'
    )


async def test_honest_image_bodies_at_once_hold_at_most_four_times_their_size(
    tmp_path: Path,
) -> None:
    # Issue 27: three 57 MiB image bodies at once peaked at 5.5x what arrived (5.0x here). The
    # raw body goes once decoded, the forwarded one once sent, and large blocks are returned to
    # the system when freed (`heap_trim.fix_mmap_threshold`): 3.4-3.8x here. vLLM runs apart
    # (here the fake, in its own process), so the peak is the proxy's alone.
    body = _image_body(40)
    store = f"sqlite:///{tmp_path / 'store.db'}"
    fake = start_fake()
    proxy = start_proxy(fake.url, store, "--max-rollout-body-rate", "0")
    try:
        base = proxy.wait_ready()
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            # A call first: what the proxy holds for any call (imports, caches) is not counted.
            async with session.post(f"{base}/r/warm/v1/chat/completions", json=_SMALL) as resp:
                assert resp.status == 200
            before = _rss_mb(proxy.pid)

            async def one(n: int) -> tuple[int, str]:
                url = f"{base}/r/images-{n}/v1/chat/completions"
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    return resp.status, resp.headers["X-Capture-Status"]

            answers = await asyncio.gather(*(one(n) for n in range(3)))
        peak = _peak_rss_mb(proxy.pid)
    finally:
        proxy.terminate()
        fake.terminate()
    assert answers == [(200, "staged")] * 3
    bodies_mb = 3 * len(body) / 2**20
    assert peak - before < 4 * bodies_mb, (
        f"peak RSS {peak:.0f} MB, {before:.0f} MB before {bodies_mb:.0f} MiB of bodies"
    )
    with open_store(store) as reader:
        for n in range(3):
            [record] = reader.calls(f"images-{n}", include_open=True)
            assert len({a.sha256 for a in record.attachments}) == body.count(b"image_url") // 2


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ProcessLookupError(pid)
