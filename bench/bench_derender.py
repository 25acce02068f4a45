"""What a streamed token-in answer costs in derender calls: one per generate event vs coalesced.

    .venv/bin/python bench/bench_derender.py --prompt-tokens 16000 --tokens 1000

Against the bundled fake vLLM (loopback, ``scale_out=True``), one streamed generate of
``--tokens`` tokens after a prompt of about ``--prompt-tokens`` ids is derendered two ways, side
by side in one run: one derender call per generate event (each resends the prompt and every
output id so far, as vLLM requires), and `capture_proxy.core.token_in.StreamedDerender`'s
coalesced calls, and the coalesced calls of a client that asked for logprobs (each paired with
the unary derender call that resolves them). ``--token-interval`` paces the fake's events, as a
model's decode rate does.
Reported: derender calls, request bytes sent to derender, and wall time; the ratio is what
matters (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson

from capture_proxy.adapters.vllm import (
    GenerateStream,
    StreamLogprobs,
    derender_chunk_body,
    derender_tail,
    read_render,
)
from capture_proxy.core.token_in import StreamedDerender
from capture_proxy.core.transport import EngineRoute
from capture_proxy.testing.fake_vllm import Turn, serve_fake
from capture_proxy.upstream import HTTPUpstream


class _Counting(HTTPUpstream):
    """An upstream client that counts the derender calls and the bytes they send."""

    calls = 0
    sent = 0

    async def post_engine(self, route: EngineRoute, body: bytes) -> Any:
        if route is EngineRoute.DERENDER:
            self.calls += 1
            self.sent += len(body)
        return await super().post_engine(route, body)


async def _per_event(up: _Counting, rendered: Any, chat: dict[str, Any]) -> None:
    stream = GenerateStream()
    state = None
    prompt = list(rendered.prompt_ids)
    async with await up.post_engine(
        EngineRoute.GENERATE, rendered.generate_body(stream=True)
    ) as reply:
        async for data in reply.chunks():
            for event in stream.feed(data):
                body = derender_chunk_body(event.data, state, derender_tail(prompt, chat))
                async with await up.post_engine(EngineRoute.DERENDER, body) as answer:
                    state = orjson.loads(await answer.read())["stream_state"]


async def _coalesced(up: _Counting, rendered: Any, chat: dict[str, Any]) -> None:
    reply = await up.post_engine(EngineRoute.GENERATE, rendered.generate_body(stream=True))
    async with reply:
        logprobs = StreamLogprobs("policy") if chat.get("logprobs") else None
        driver = StreamedDerender(up, reply, list(rendered.prompt_ids), chat, logprobs=logprobs)
        async for _ in driver.events():
            pass


async def main(prompt_tokens: int, tokens: int, interval: float) -> None:
    fake, runner, url = await serve_fake(
        scale_out=True, max_model_len=prompt_tokens + tokens + 64, chunk_delay=interval
    )
    chat = {
        "model": "policy",
        "messages": [{"role": "user", "content": "x" * prompt_tokens}],
        "max_tokens": tokens,
    }
    try:
        # The last row: the client asked for logprobs (top 5), resolved by a unary derender
        # call beside each coalesced one.
        logprobs = {**chat, "logprobs": True, "top_logprobs": 5}
        for name, run, body in (
            ("per event", _per_event, chat),
            ("coalesced", _coalesced, chat),
            ("+logprobs", _coalesced, logprobs),
        ):
            up = _Counting(url)
            async with await up.post_engine(EngineRoute.RENDER, orjson.dumps(body)) as reply:
                rendered = read_render(await reply.read())
            fake.push(Turn("y" * tokens, finish_reason="length"))
            start = time.perf_counter()
            await run(up, rendered, body)
            took = time.perf_counter() - start
            await up.close()
            print(
                f"{name:>10}: {up.calls:5d} derender calls, {up.sent / 1e6:8.1f} MB sent, "
                f"{took:6.2f} s ({len(rendered.prompt_ids)} prompt ids, {tokens} tokens)"
            )
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=16000)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument(
        "--token-interval", type=float, default=0.0, help="seconds between generate events"
    )
    args = parser.parse_args()
    asyncio.run(main(args.prompt_tokens, args.tokens, args.token_interval))
