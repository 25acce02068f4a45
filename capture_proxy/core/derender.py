"""A streamed token-in answer for the client: a generate stream derendered in coalesced calls.

`StreamedDerender` reads vLLM's streamed generate and asks ``/v1/chat/completions/derender`` for
the client's Chat Completions chunks. Each derender call resends the whole prompt and every output
id so far (vLLM keeps no state), so the calls are coalesced by
`capture_proxy.adapters.vllm.DerenderCoalescer`: the first event alone, then everything that
arrived while the previous call was in flight (and at least `min_interval` seconds after it
started), in one call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import orjson

from ..adapters.vllm import (
    DerenderCoalescer,
    Generated,
    GenerateStream,
    derender_chunk_body,
    derender_tail,
    read_derender,
)
from ..errors import UpstreamFailed
from .transport import EngineRoute, TokenInTransport, UpstreamReply

__all__ = ["StreamedDerender"]

_DONE = b"data: [DONE]\n\n"


class StreamedDerender:
    """Turns a streamed generate reply into the client's SSE chunks.

    ``async for event in StreamedDerender(...).events()`` yields each ``data:`` event for the
    client (``[DONE]`` last); afterwards `generated` is the whole generation (ids, logprobs,
    spans, finish, usage) and `calls` the number of derender calls made. A derender answer other
    than 200 raises `UpstreamFailed` (code ``derender_failed``) with vLLM's message.
    """

    def __init__(
        self,
        transport: TokenInTransport,
        generate: UpstreamReply,
        prompt_ids: Sequence[int],
        chat_request: Mapping[str, Any] | bytes,
        *,
        min_interval: float = 0.05,
        ids_json: bytes | None = None,
    ) -> None:
        self._transport = transport
        self._generate = generate
        # Resent on every derender call (vLLM keeps no state): encoded once (`ids_json`: the
        # prompt ids already encoded, as generate got them).
        self._tail = derender_tail(prompt_ids, chat_request, ids_json=ids_json)
        self._stream = GenerateStream()
        self._coalescer = DerenderCoalescer(min_interval)
        self._arrived = asyncio.Event()
        self._read_done = False
        self.generated: Generated | None = None

    @property
    def calls(self) -> int:
        return self._coalescer.calls

    async def _read(self) -> None:
        try:
            async for data in self._generate.chunks():
                for event in self._stream.feed(data):
                    self._coalescer.add(event)
                    self._arrived.set()
            self.generated = self._stream.finish()
        finally:
            self._read_done = True
            self._coalescer.close()
            self._arrived.set()

    async def _derender(self, chunk: bytes, state: Any) -> dict[str, Any]:
        body = derender_chunk_body(chunk, state, self._tail)
        async with await self._transport.post_engine(EngineRoute.DERENDER, body) as reply:
            raw = await reply.read()
            if reply.status != 200:
                text = raw[:500].decode(errors="replace")
                raise UpstreamFailed(
                    f"derender answered {reply.status}: {text}", code="derender_failed"
                )
        return read_derender(raw)

    async def events(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(self._read())
        state: Any = None
        try:
            while True:
                chunk = self._coalescer.take(loop.time())
                if chunk is None:
                    if self._read_done and not self._coalescer.pending:
                        break
                    due = self._coalescer.due() if self._coalescer.pending else None
                    self._arrived.clear()
                    if due is None:
                        await self._arrived.wait()
                    else:
                        # Too soon after the last call: wait for it, or for the stream's end.
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout_at(due):
                                await self._arrived.wait()
                    continue
                answer = await self._derender(chunk, state)
                self._coalescer.finished()
                state = answer.get("stream_state")
                yield b"data: " + orjson.dumps(answer["chunk"]) + b"\n\n"
            await reader  # raises what the generate stream raised
            yield _DONE
        finally:
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
