"""The open-file limit (issue 19): ``capture-proxy serve`` raises its soft limit, sizes its
connection cap to it, and when descriptors do run out it keeps serving and logs a count, not a
traceback per event.

Each test runs ``python -m capture_proxy serve`` as a child process whose RLIMIT_NOFILE is set low
before it starts (`preexec_fn`), in front of a fake vLLM served by the test, and floods it with
more connections than it has descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from aiohttp.test_utils import TestServer

from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.support import ROOT

BODY = orjson.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
REQUEST = (
    b"POST /r/fd/v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
)
FLOOD = 400  # connections opened and held at once: more than the child has descriptors


@dataclass
class Child:
    proc: asyncio.subprocess.Process
    log: Path
    port: int

    def text(self) -> str:
        return self.log.read_text()

    def warnings(self) -> list[str]:
        """The lines of the log that are not the per-request access log."""
        return [
            line
            for line in self.text().splitlines()
            if '"logger":"capture_proxy.access"' not in line
        ]


def _limit(soft: int, hard: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.asynccontextmanager
async def child(tmp_path: Path, soft: int, hard: int, *args: str) -> AsyncIterator[Child]:
    fake = FakeVLLM()
    upstream = TestServer(fake.app())
    await upstream.start_server()
    log = tmp_path / "proxy.log"
    argv = [sys.executable, "-m", "capture_proxy", "serve", "--port", "0"]
    argv += ["--upstream", str(upstream.make_url("")).rstrip("/")]
    argv += ["--store", f"sqlite:///{tmp_path / 'store.db'}", "--min-free-disk-mb", "0", *args]
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limit(soft, hard)
        )
    try:
        started = time.monotonic()
        while not (found := re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text())):
            assert proc.returncode is None, log.read_text()
            assert time.monotonic() - started < 30, log.read_text()
            await asyncio.sleep(0.05)
        yield Child(proc, log, int(found.group(1)))
    finally:
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(60):
            await proc.wait()
        await upstream.close()


async def call(port: int) -> tuple[int, str]:
    """One chat call on a fresh connection: its status and X-Capture-Status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(REQUEST)
        async with asyncio.timeout(15):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        found = re.search(r"(?im)^x-capture-status: (\S+)", head)
        return int(head.split()[1]), found.group(1) if found else ""
    finally:
        writer.close()


async def flood(port: int, n: int) -> tuple[list[asyncio.StreamWriter], list[bytes]]:
    """Open `n` connections at once and hold them; what each got within a second (if any)."""

    async def one() -> tuple[asyncio.StreamWriter | None, bytes]:
        try:
            async with asyncio.timeout(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except (OSError, TimeoutError):
            return None, b""
        try:
            async with asyncio.timeout(1):
                got = await reader.read(4096)
        except (OSError, TimeoutError):
            got = b""
        return writer, got

    results = await asyncio.gather(*(one() for _ in range(n)))
    return [w for w, _ in results if w is not None], [got for _, got in results]


def _release(writers: list[asyncio.StreamWriter]) -> None:
    for w in writers:
        w.close()


async def test_serve_raises_the_soft_open_file_limit_to_the_hard_one(tmp_path: Path) -> None:
    async with child(tmp_path, 256, 1024) as c:
        limits = await asyncio.to_thread(Path(f"/proc/{c.proc.pid}/limits").read_text)
        [line] = [x for x in limits.splitlines() if x.startswith("Max open files")]
        assert line.split()[3:5] == ["1024", "1024"], line
        assert "open-file limit raised from 256 to 1024" in c.text()
        assert "taking up to 408 client connections" in c.text()
        assert await call(c.port) == (200, "staged")


async def test_at_the_open_file_limit_the_cap_refuses_and_the_proxy_keeps_serving(
    tmp_path: Path,
) -> None:
    async with child(tmp_path, 320, 320, "--client-header-timeout", "30") as c:
        assert "--max-connections 4096 lowered to 56" in c.text()
        writers, answers = await flood(c.port, FLOOD)
        # The connections over the cap were told so, at once, in the OpenAI error form...
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(refused) >= FLOOD - 56 - 10, (len(refused), len(writers))
        assert all(b"too_many_connections" in a and b"Retry-After: 1" in a for a in refused)
        # ...and while the flood holds every slot, a call gets the same clear refusal.
        assert (await call(c.port))[0] == 503
        _release(writers)
        await asyncio.sleep(0.5)
        assert [await call(c.port) for _ in range(3)] == [(200, "staged")] * 3
        # Descriptors never ran out, and the refusals were logged as a count, not one by one.
        assert "out of system resource" not in c.text()
        assert len(c.warnings()) < 30, c.warnings()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_when_descriptors_run_out_it_keeps_serving_and_logs_a_bounded_count(
    tmp_path: Path, loop: str
) -> None:
    # No caps (--max-connections 0, none per address, no rate per address): the flood takes every
    # descriptor, so accept() fails with EMFILE. Before, asyncio logged a traceback for each
    # failure: 19 MB in 30 s at 256 fds.
    # uvloop (libuv) logs nothing: it closes a reserved descriptor, accepts the pending
    # connection and closes it at once, so the client sees its connection closed.
    async with child(
        tmp_path,
        200,
        200,
        "--max-connections",
        "0",
        "--max-connections-per-address",
        "0",
        "--max-connection-rate-per-address",
        "0",
        "--client-header-timeout",
        "30",
        "--loop",
        loop,
    ) as c:
        writers, _ = await flood(c.port, FLOOD)
        await asyncio.sleep(2)  # asyncio retries accept() once a second meanwhile
        _release(writers)
        await asyncio.sleep(1.5)
        assert [await call(c.port) for _ in range(3)] == [(200, "staged")] * 3
        c.proc.terminate()  # at exit the filter reports what it held back
        async with asyncio.timeout(60):
            await c.proc.wait()
        text = c.text()
        if loop == "asyncio":
            assert "out of system resource" in text
            assert re.search(r"\d+ more like this not logged in \d+s: socket.accept\(\)", text)
        assert len(c.warnings()) < 40, c.warnings()
        assert len(text) < 200_000
