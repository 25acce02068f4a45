"""Processes and load for the reliability suites (crash loop, soak) and their scripts.

`Spawned` runs ``capture-proxy serve`` (or this file's fake vLLM server) as a real child process
and collects its output on a thread; `Loader` plays many agent sandboxes at once against a proxy
URL, remembering every call whose answer said ``staged`` (the ``X-Capture-Status`` header, or the
``: capture-status staged call_id=...`` line of a stream). Sessions survive a proxy restart, so the
next proxy process resumes their rollouts from the store. The drivers built on them are
``scripts/crash_loop.py`` and ``scripts/soak.py`` (the tests run their short variants).

    python -m tests.support.reliability_workers fake [--latency S] [--chunk-delay S]

serves the bundled fake vLLM on a free loopback port, prints ``fake vLLM on http://...`` and runs
until killed (its request log is trimmed, so a long soak does not grow it). Run it from the
repository root, as `start_fake` does.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.support import ROOT

_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
_FAKE = re.compile(r"fake vLLM on (http://127\.0\.0\.1:\d+)")
_STAGED_LINE = re.compile(rb"^: capture-status (staged|capture_failed) call_id=(\S+)")


def rss_mb(pid: int) -> float:
    """Resident memory of a process, in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ProcessLookupError(pid)


def open_fds(pid: int) -> int:
    """How many file descriptors a process holds open (Linux /proc)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class Spawned:
    """A child process whose stdout+stderr lines are collected on a thread."""

    def __init__(self, argv: Sequence[str], ready: re.Pattern[str], *, cwd: Path | None = None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._ready_pattern = ready
        self._ready = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = self._ready_pattern.search(line)
            if m and not self._ready.is_set():
                self.url = m.group(1)
                self._ready.set()

    def wait_ready(self, timeout: float = 30.0) -> str:
        """The URL the process announced; raises with its output if it did not start (at once
        when it exited)."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()  # and read the rest of its output
                if self._ready.is_set():
                    break  # it announced its URL, then exited: the caller finds out
                raise RuntimeError(f"{self.proc.args!r} did not start:\n{self.output()}")
        return self.url

    def kill(self) -> int:
        """SIGKILL (if still running); the return code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        rc = self.proc.wait(timeout=30)
        self._reader.join(timeout=10)
        return rc

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for a clean exit; SIGKILL after `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = self.kill()
        self._reader.join(timeout=10)
        return rc

    def output(self) -> str:
        return "\n".join(self.lines[-200:])


def start_fake(*, latency: float = 0.0, chunk_delay: float = 0.0) -> Spawned:
    argv = [sys.executable, "-m", "tests.support.reliability_workers", "fake"]
    argv += ["--latency", str(latency), "--chunk-delay", str(chunk_delay)]
    fake = Spawned(argv, _FAKE, cwd=ROOT)
    fake.wait_ready()
    return fake


def start_proxy(upstream: str, store: str, *extra: str, cwd: Path | None = None) -> Spawned:
    """``python -m capture_proxy serve`` on a free port; wait for it with `Spawned.wait_ready`."""
    argv = [sys.executable, "-m", "capture_proxy", "serve", "--upstream", upstream]
    argv += ["--store", store, "--port", "0", "--min-free-disk-mb", "64", *extra]
    return Spawned(argv, _LISTENING, cwd=cwd)


# -- the load ---------------------------------------------------------------------------------


def _image_url(rng: random.Random) -> str:
    data = b"\x89PNG\r\n\x1a\n" + rng.randbytes(rng.randrange(1024, 6144))
    return "data:image/png;base64," + base64.b64encode(data).decode()


@dataclass
class _Session:
    rollout: str
    messages: list[dict[str, Any]]
    turn: int = 0


@dataclass
class Loader:
    """Agent-like sessions sent concurrently: multi-turn, some streamed, some with images.

    `acked` maps every call id whose answer said ``staged`` to its rollout; `outcomes` counts
    what the calls got (``staged``, ``capture_failed``, ``http_<status>``, ``conn_error``, ...).
    `sealed` holds the rollouts it sealed (with `admin_token`).
    `latencies` holds the seconds of calls that completed (a bounded reservoir).
    """

    name: str
    concurrency: int = 16
    seed: int = 0
    turns: int = 8
    stream_ratio: float = 0.5
    image_ratio: float = 0.3
    max_tokens: int = 160
    #: With the proxy's admin token, each finished session's rollout is sealed (as a driver does).
    admin_token: str | None = None
    acked: dict[str, str] = field(default_factory=dict)
    #: The rollouts whose seal the proxy answered 200.
    sealed: set[str] = field(default_factory=set)
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    _sessions: list[_Session] = field(default_factory=list)
    _started: int = 0
    _stop: asyncio.Event | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _http: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._sessions = [self._new_session() for _ in range(self.concurrency)]

    def _new_session(self) -> _Session:
        n = self._started
        self._started += 1
        content: Any = f"task {n}: list the files and explain what {self.name} does"
        if self.rng.random() < self.image_ratio:
            content = [
                {"type": "text", "text": content},
                {"type": "image_url", "image_url": {"url": _image_url(self.rng)}},
            ]
        return _Session(f"{self.name}-s{n}", [{"role": "user", "content": content}])

    def start(self, base_url: str) -> None:
        """Start the sandboxes against `base_url` (a proxy); `stop` ends them."""
        self._stop = asyncio.Event()
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=120),
        )
        self._tasks = [
            asyncio.ensure_future(self._worker(base_url, i)) for i in range(self.concurrency)
        ]

    async def stop(self, *, finish_within: float = 0.0) -> int:
        """Stop the sandboxes: at once (calls in flight are abandoned), or after letting their
        current calls finish for up to `finish_within` seconds. Returns how many sandboxes were
        still in a call when they were stopped (0 when stopped already)."""
        if self._stop is None or self._http is None or self._http.closed:
            return 0
        self._stop.set()
        if finish_within > 0 and self._tasks:
            await asyncio.wait(self._tasks, timeout=finish_within)
        cut = sum(1 for task in self._tasks if not task.done())
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.close()
        return cut

    async def _worker(self, base_url: str, i: int) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            s = self._sessions[i]
            body = {
                "model": "policy",
                "messages": s.messages,
                "max_tokens": self.max_tokens,
                "stream": self.rng.random() < self.stream_ratio,
            }
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            url = f"{base_url}/r/{s.rollout}/v1/chat/completions"
            started = time.perf_counter()
            try:
                outcome, text = await self._call(url, body)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                self.outcomes["conn_error"] += 1
                await asyncio.sleep(0.05)  # the proxy is down (killed): try again shortly
                continue
            self.outcomes[outcome] += 1
            if len(self.latencies) < 100_000:
                self.latencies.append(time.perf_counter() - started)
            if outcome not in ("staged", "capture_failed"):
                await asyncio.sleep(0.05)
                continue  # the same request again: a sandbox retrying
            s.turn += 1
            if s.turn >= self.turns:
                self._sessions[i] = self._new_session()
                if self.admin_token:
                    await self._seal(base_url, s.rollout)
                continue
            s.messages = [
                *s.messages,
                {"role": "assistant", "content": text or "(no answer)"},
                self._next_user(s),
            ]

    async def _seal(self, base_url: str, rollout: str) -> None:
        assert self._http is not None
        url = f"{base_url}/admin/rollouts/{rollout}/seal"
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        try:
            async with self._http.post(url, headers=headers) as resp:
                await resp.read()
                self.outcomes["sealed" if resp.status == 200 else f"seal_{resp.status}"] += 1
                if resp.status == 200:
                    self.sealed.add(rollout)
        except (aiohttp.ClientError, TimeoutError):
            self.outcomes["conn_error"] += 1

    def _next_user(self, s: _Session) -> dict[str, Any]:
        text = f"turn {s.turn}: now run step {self.rng.randrange(1000)} and report"
        if s.turn % 4 == 3 and self.rng.random() < self.image_ratio:
            return {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": _image_url(self.rng)}},
                ],
            }
        return {"role": "user", "content": text}

    async def _call(self, url: str, body: dict[str, Any]) -> tuple[str, str]:
        assert self._http is not None
        rollout = url.split("/r/", 1)[1].split("/", 1)[0]
        headers = {"Content-Type": "application/json"}
        async with self._http.post(url, data=orjson.dumps(body), headers=headers) as resp:
            status = resp.headers.get("X-Capture-Status", "")
            call_id = resp.headers.get("X-Capture-Call-Id", "")
            if resp.status != 200:
                await resp.read()
                return f"http_{resp.status}", ""
            if status == "staged":
                self.acked[call_id] = rollout  # acknowledged: from here on it must not be lost
            if not body["stream"]:
                answer = orjson.loads(await resp.read())
                return status, answer["choices"][0]["message"].get("content") or ""
            return await self._read_stream(resp, rollout)

    async def _read_stream(self, resp: aiohttp.ClientResponse, rollout: str) -> tuple[str, str]:
        parts: list[str] = []
        outcome = "stream_cut"
        async for raw in resp.content:
            line = raw.rstrip(b"\r\n")
            m = _STAGED_LINE.match(line)
            if m:
                outcome = m.group(1).decode()
                if outcome == "staged":
                    self.acked[m.group(2).decode()] = rollout
            elif line == b"data: [DONE]":
                return outcome, "".join(parts)
            elif line.startswith(b"data: "):
                event = orjson.loads(line[6:])
                if "error" in event:
                    return f"stream_error_{event['error'].get('code')}", ""
                for choice in event.get("choices") or ():
                    parts.append(choice.get("delta", {}).get("content") or "")
        return outcome, "".join(parts)


# -- the fake upstream as its own process -----------------------------------------------------


async def _serve_fake(latency: float, chunk_delay: float) -> None:
    from capture_proxy.testing.fake_vllm import serve_fake

    fake, runner, url = await serve_fake(latency=latency, chunk_delay=chunk_delay)
    print(f"fake vLLM on {url}", flush=True)
    try:
        while True:
            await asyncio.sleep(5)
            # The fake records every request for assertions; a soak does not read them.
            del fake.requests[:], fake.responses[:], fake.request_headers[:]
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    fake = sub.add_parser("fake", help="serve the fake vLLM on a free loopback port")
    fake.add_argument("--latency", type=float, default=0.0)
    fake.add_argument("--chunk-delay", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(_serve_fake(args.latency, args.chunk_delay))


if __name__ == "__main__":
    main()
