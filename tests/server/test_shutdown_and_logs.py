"""SIGTERM drains in-flight streams before exiting; logs are JSON lines with ids, never bodies."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer

from capture_proxy.read.reader import open_store
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn

SECRET = "sk-never-log-me"
PROMPT = "my private prompt text"


async def _start(
    tmp_path: Path, upstream: str
) -> tuple[asyncio.subprocess.Process, str, list[str]]:
    """The proxy process, its URL (from the banner, on stderr) and the stderr lines read so far."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "capture_proxy",
        "serve",
        "--upstream",
        upstream,
        "--store",
        f"sqlite:///{tmp_path / 'c.db'}",
        "--port",
        "0",
        "--shutdown-timeout",
        "20",
        "--upstream-api-key",
        SECRET,
        "--min-free-disk-mb",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url, seen = await _banner(proc)
    return proc, url, seen


async def _banner(proc: asyncio.subprocess.Process) -> tuple[str, list[str]]:
    """Read stderr up to the banner (log lines come first); its URL and the lines read."""
    assert proc.stderr is not None
    seen: list[str] = []
    for _ in range(20):
        seen.append((await asyncio.wait_for(proc.stderr.readline(), 30)).decode())
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", seen[-1])
        if match:
            return match.group(1), seen
    raise AssertionError(f"the proxy did not start: {seen}")


async def test_sigterm_lets_an_open_stream_finish_and_stage(tmp_path: Path) -> None:
    fake = FakeVLLM(chunk_delay=0.02, api_key=SECRET)
    fake.push(Turn("word " * 40))
    upstream = TestServer(fake.app())
    await upstream.start_server()
    proc, base, early = await _start(tmp_path, str(upstream.make_url("")).rstrip("/"))
    try:
        async with aiohttp.ClientSession() as http:
            body = {
                "model": "policy",
                "stream": True,
                "messages": [{"role": "user", "content": PROMPT}],
            }
            async with http.post(f"{base}/r/ep/v1/chat/completions", json=body) as resp:
                first = await resp.content.readline()
                assert first.startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)  # mid-stream
                rest = await asyncio.wait_for(resp.content.read(), 30)
            lines = [x for x in (first + rest).split(b"\n") if x]
            assert lines[-1] == b"data: [DONE]"
            assert lines[-2].startswith(b": capture-status staged call_id=")
            call_id = lines[-2].split(b"call_id=")[1].decode()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await upstream.close()
    with open_store(f"sqlite:///{tmp_path / 'c.db'}") as store:
        (record,) = store.calls("ep", include_open=True)
        store.verify()
    assert record.call_id == call_id

    assert proc.stderr is not None
    assert proc.stdout is not None
    assert (await proc.stdout.read()) == b""  # the banner and the logs go to stderr
    logs = "".join(early) + (await proc.stderr.read()).decode()
    log_lines = [line for line in logs.splitlines() if line.strip()]
    entries = [json.loads(line) for line in log_lines if line.startswith("{")]
    # Besides JSON log lines, stderr holds only the plain banner (its lines and the goodbye).
    banner = [line for line in log_lines if not line.startswith("{")]
    assert banner[0].startswith("capture-proxy listening on http://127.0.0.1:"), banner
    assert all(line.startswith(("capture-proxy ", "  ")) for line in banner), banner
    # The start-up settings are JSON fields a log pipeline can query, secrets masked.
    (started,) = [e for e in entries if e["msg"] == "starting"]
    assert started["settings"]["port"] == 0
    assert started["settings"]["shutdown_timeout"] == 20.0
    assert started["settings"]["upstream_api_key"] == "***"
    access = [e for e in entries if e["logger"] == "capture_proxy.access"]
    (chat,) = [e for e in access if e["route"].endswith("/chat/completions")]
    assert chat["call_id"] == call_id
    assert chat["rollout_id"] == "ep"
    assert chat["status"] == "staged"
    assert {"ts", "level", "msg"} <= set(chat)
    assert SECRET not in logs
    assert PROMPT not in logs


async def test_calls_cut_by_the_shutdown_deadline_are_recorded_as_such(tmp_path: Path) -> None:
    fake = FakeVLLM(chunk_delay=0.2, api_key=SECRET)
    fake.push(Turn("word " * 100))  # ~40 s of stream: far past the deadline
    upstream = TestServer(fake.app())
    await upstream.start_server()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "capture_proxy",
        "serve",
        "--upstream",
        str(upstream.make_url("")).rstrip("/"),
        "--store",
        f"sqlite:///{tmp_path / 'c.db'}",
        "--port",
        "0",
        "--shutdown-timeout",
        "1",
        "--upstream-api-key",
        SECRET,
        "--min-free-disk-mb",
        "0",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        base, _ = await _banner(proc)
        assert proc.stderr is not None
        # Keep reading the logs, so a full pipe never stalls the proxy's shutdown.
        drain = asyncio.create_task(proc.stderr.read())
        async with aiohttp.ClientSession() as http:
            body = {
                "model": "policy",
                "stream": True,
                "messages": [{"role": "user", "content": "x"}],
            }
            async with http.post(f"{base}/r/ep/v1/chat/completions", json=body) as resp:
                await resp.content.readline()
                proc.send_signal(signal.SIGTERM)
                try:
                    rest = await asyncio.wait_for(resp.content.read(), 30)
                except aiohttp.ClientPayloadError:
                    rest = b""  # the connection was cut: the client knows it is incomplete
        assert b"[DONE]" not in rest  # never presented as a whole answer
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        await drain
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await upstream.close()
    with open_store(f"sqlite:///{tmp_path / 'c.db'}") as store:
        (entry,) = store.failures("ep")
        assert store.calls("ep", include_open=True) == []
    assert entry.status == "aborted"
    assert entry.reason == "shutdown"
