"""Load that replays agent sessions as OpenCode does, in its own process (the token-in scenarios).

    .venv/bin/python bench/session_load.py --url http://127.0.0.1:PORT --concurrency 2 \
        --duration 8 [--stream] [--tag run1] [--loop uvloop]

Closed loop: `concurrency` workers each play sessions one after the other, a session being
`TOOL_TURNS` + 1 calls in one rollout (``X-Rollout-Id: <tag>-<worker>-<n>``). The first call is a
system prompt of about `SYSTEM_BYTES` bytes, `TOOLS` and a user message; each later call replays
the previous answer as OpenCode does (``content`` a string, the reasoning as ``reasoning``, tool
arguments re-serialized compactly) and appends a tool result, so each call extends the previous
one and token-in bridges it. Against `fake_upstream.py` (byte-level tokenizer) the prompts grow
from about 18k to 20k ids.

Prints one JSON object, as `loadgen.py` does: per-call latencies and times to first body byte
(ok calls only), counts, a few error messages, the elapsed time. A call is ok when it answers 200
and, through capture-proxy, was staged. A session whose call failed ends there.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import aiohttp
import orjson
from load_result import write_result

from capture_proxy.server.event_loop import LOOPS, run

#: Tool calls per session before the final answer (`fake_upstream.py` answers by this count).
TOOL_TURNS = 3
SYSTEM_BYTES = 16_000
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name}: "
            + "Runs the operation on the workspace and returns its output. " * 6,
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "what to run"}},
                "required": ["command"],
            },
        },
    }
    for name in ("bash", "read", "write", "edit", "glob", "grep", "list", "webfetch", "todo")
]
_SENTENCE = "You are a coding agent working in a repository; use the tools, keep answers short. "
SYSTEM = {
    "role": "system",
    "content": (_SENTENCE * (SYSTEM_BYTES // len(_SENTENCE) + 1))[:SYSTEM_BYTES],
}
TOOL_OUTPUT = "drwxr-xr-x  2 user user 4096 Dec  1 12:00 src\n" * 8


class Sessions:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.url = args.url.rstrip("/") + "/v1/chat/completions"
        self.latencies: list[float] = []
        self.ttfbs: list[float] = []
        self.errors: list[str] = []
        self.sent = 0
        self.session: aiohttp.ClientSession

    async def call(self, rollout: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """One call; the assistant message the client saw, or None (an error is noted)."""
        stream = self.args.stream
        headers = {"Content-Type": "application/json", "X-Rollout-Id": rollout}
        self.sent += 1
        t0 = time.perf_counter()
        try:
            async with (
                asyncio.timeout(self.args.timeout),
                self.session.post(self.url, data=orjson.dumps(body), headers=headers) as resp,
            ):
                first = await resp.content.readany()
                ttfb = time.perf_counter() - t0
                data = first + await resp.read()
                elapsed = time.perf_counter() - t0
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
            return None
        if resp.status != 200:
            self.errors.append(f"HTTP {resp.status}: {data[:200]!r}")
            return None
        captured = resp.headers.get("X-Capture-Status")
        if stream:
            staged = b"\n: capture-status staged" in data
            if captured is not None and not staged:
                self.errors.append(f"stream not staged: {data[-160:]!r}")
                return None
            message = _streamed_message(data)
        else:
            if captured is not None and captured != "staged":
                self.errors.append(f"X-Capture-Status: {captured}")
                return None
            message = orjson.loads(data)["choices"][0]["message"]
        self.latencies.append(elapsed)
        self.ttfbs.append(ttfb)
        return message

    async def play(self, rollout: str) -> None:
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "List the files."}]
        for _ in range(TOOL_TURNS + 1):
            body = {
                "model": "policy",
                "messages": messages,
                "tools": TOOLS,
                "temperature": 0,
                "max_tokens": 2048,
                "stream": self.args.stream,
            }
            answer = await self.call(rollout, body)
            if answer is None or not answer.get("tool_calls"):
                return
            results = [
                {"role": "tool", "tool_call_id": c["id"], "content": TOOL_OUTPUT}
                for c in answer["tool_calls"]
            ]
            messages = [*messages, _replayed(answer), *results]

    async def run(self) -> dict[str, Any]:
        a = self.args
        loop = asyncio.get_running_loop()
        end = loop.time() + a.duration

        async def worker(w: int) -> None:
            n = 0
            while loop.time() < end:
                await self.play(f"{a.tag}-{w}-{n}")
                n += 1

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as self.session:
            t0 = time.perf_counter()
            workers = [asyncio.create_task(worker(w)) for w in range(a.concurrency)]
            _, late = await asyncio.wait(workers, timeout=a.duration + a.drain)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
                self.errors += [f"session not finished {a.drain:g}s after the end"] * len(late)
            elapsed = time.perf_counter() - t0
        return {
            "sent": self.sent,
            "ok": len(self.latencies),
            "errors": len(self.errors),
            "error_samples": sorted(set(self.errors))[:5],
            "elapsed": elapsed,
            "latencies": self.latencies,
            "ttfbs": self.ttfbs,
        }


def _replayed(answer: dict[str, Any]) -> dict[str, Any]:
    """The assistant message OpenCode sends back: reasoning as `reasoning`, compact arguments."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.get("content") or ""}
    if answer.get("reasoning"):
        message["reasoning"] = answer["reasoning"]
    message["tool_calls"] = [
        {
            "id": c["id"],
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": orjson.dumps(orjson.loads(c["function"]["arguments"])).decode(),
            },
        }
        for c in answer["tool_calls"]
    ]
    return message


def _streamed_message(data: bytes) -> dict[str, Any]:
    """A stream's deltas joined into one assistant message."""
    content, reasoning = [], []
    calls: dict[int, dict[str, Any]] = {}
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        for choice in orjson.loads(line[6:])["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning") or "")
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
                call["id"] = piece.get("id") or call.get("id")
                function = piece.get("function") or {}
                call["function"]["name"] = function.get("name") or call["function"].get("name")
                call["function"]["arguments"] += function.get("arguments") or ""
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "tool_calls": [calls[i] for i in sorted(calls)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--mode", choices=("closed",), default="closed")
    p.add_argument("--concurrency", type=int, default=2, help="sessions played at once")
    p.add_argument(
        "--duration", type=float, default=8.0, help="seconds during which sessions start"
    )
    p.add_argument("--count", type=int, default=0, help="ignored (loadgen.py's warm-up option)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--seed", type=int, default=1, help="ignored: sessions are deterministic")
    p.add_argument("--tag", default="bench", help="rollout id prefix")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    p.add_argument("--drain", type=float, default=20.0, help="seconds to finish sessions after")
    p.add_argument("--loop", choices=LOOPS, default=LOOPS[0], help="event loop")
    p.add_argument("--out", default=None, help="write the result (JSON) here, not to stdout")
    args = p.parse_args()
    result = run(Sessions(args).run(), args.loop)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
