"""The bundled fake vLLM for the token-in scenarios, in its own process.

    .venv/bin/python bench/fake_upstream.py [--port 0] [--latency 0] [--loop uvloop]

Serves `capture_proxy.testing.fake_vllm` with the scale-out routes (render, generate, derender)
and Qwen3's template (earlier reasoning dropped: not append-only), answering the agent sessions of
`session_load.py`: a `bash` tool call with reasoning while the conversation holds fewer than
`session_load.TOOL_TURNS` tool results, then a final answer. A chat body is read by its tool
messages; a generate body (prompt ids only) by its count of ``<tool_response>`` ids, so telling
the turns apart costs the fake no decoding. Prints ``listening on http://127.0.0.1:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from session_load import TOOL_TURNS

from capture_proxy.server.event_loop import LOOPS, run
from capture_proxy.testing.fake_vllm import FakeToolCall, Turn, serve_fake
from capture_proxy.testing.fake_vllm._template import SPECIAL_TOKENS

#: The fake tokenizer's id of ``<tool_response>``: one per tool result in a rendered prompt.
TOOL_RESPONSE_ID = SPECIAL_TOKENS["<tool_response>"]
REASONING = "The user wants the files listed and counted. " * 4
FINAL = "Here are the files, counted: " + "a.txt b.txt main.py " * 12


def answer(body: dict[str, Any]) -> Turn:
    """A tool call until the session has `TOOL_TURNS` results, then the final answer."""
    if "messages" in body:
        results = sum(1 for m in body["messages"] if m.get("role") == "tool")
    else:
        results = body["token_ids"].count(TOOL_RESPONSE_ID)
    if results < TOOL_TURNS:
        call = FakeToolCall("bash", {"command": f"ls -la dir{results}"})
        return Turn("", reasoning=REASONING, tool_calls=[call])
    return Turn(FINAL, reasoning=REASONING)


async def serve(port: int, latency: float) -> None:
    _, runner, url = await serve_fake(
        port=port,
        script=answer,
        scale_out=True,
        drop_past_reasoning=True,
        latency=latency,
        max_model_len=1 << 20,
    )
    print(f"listening on {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    p.add_argument("--loop", choices=LOOPS, default=LOOPS[0], help="event loop")
    args = p.parse_args()
    run(serve(args.port, args.latency), args.loop)


if __name__ == "__main__":
    main()
