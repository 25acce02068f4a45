"""A streamed token-in answer for the client: a generate stream derendered in coalesced calls.

`StreamedDerender` reads vLLM's streamed generate and asks ``/v1/chat/completions/derender`` for
the client's Chat Completions chunks. vLLM keeps no state between derender calls: each resends the
prompt ids, the chat request and every output id so far. What it resends is only what derender
reads (the caller passes the prompt's tail and the chat request without the conversation's text:
`derender_prompt_start`, `derender_chat_request`), and the calls are coalesced by
`capture_proxy.adapters.vllm.DerenderCoalescer`: the first event alone, then everything that
arrived while the previous call was in flight (and at least `min_interval` seconds after it
started), in one call; with a byte `budget`, once the calls sent that much, the rest of the
stream in one call at its end.

When the client asked for logprobs, each call that carries some is paired with a unary derender
call, made at the same time, that resolves them (`capture_proxy.adapters.vllm.StreamLogprobs`):
vLLM's streamed derender leaves them null when the server has a reasoning or tool parser. A
server whose streamed derender gives them (no parser) is asked no more once it has.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import orjson

from ...adapters.vllm import (
    DerenderCoalescer,
    Generated,
    GenerateStream,
    StopTokenStrip,
    StreamLogprobs,
    derender_chunk_body,
    derender_generate_answer,
    derender_tail,
    read_derender,
    usage_chunk,
)
from ...errors import UpstreamFailed
from ..transport import EngineRoute, TokenInTransport, UpstreamReply

__all__ = ["StreamedDerender", "post_derender"]

_DONE = b"data: [DONE]\n\n"
#: What a first derender call's event and state are counted as, beside the call's tail.
_FIRST_CHUNK = 512


async def post_derender(transport: TokenInTransport, body: bytes) -> bytes:
    """POST `body` to the upstream's derender route; its answer's bytes, or `UpstreamFailed`
    (`derender_failed`, naming the status and the start of the answer) when it is not a 200."""
    async with await transport.post_engine(EngineRoute.DERENDER, body) as reply:
        raw = await reply.read()
    if reply.status != 200:
        text = raw[:500].decode(errors="replace")
        raise UpstreamFailed(f"derender answered {reply.status}: {text}", code="derender_failed")
    return raw


class StreamedDerender:
    """Turns a streamed generate reply into the client's SSE chunks.

    ``async for event in StreamedDerender(...).events()`` yields each ``data:`` event for the
    client (``[DONE]`` last); afterwards `generated` is the whole generation (ids, logprobs,
    spans, finish, usage) and `calls` the number of derender calls made. A derender answer other
    than 200 raises `UpstreamFailed` (code ``derender_failed``) with vLLM's message.

    With `logprobs` (the client asked for them), each chunk with logprobs gets them resolved
    (module docs); `resolves` counts those calls. `budget`: the bytes of derender requests after
    which the rest of the stream waits for its end (`DerenderCoalescer`; None: no bound), each
    request counted with `head` bytes for its line and headers. Each call sends generate's
    events without their nulls, and without logprobs the client does not get
    (`derender_generate_answer`).
    """

    def __init__(
        self,
        transport: TokenInTransport,
        generate: UpstreamReply,
        prompt_ids: Sequence[int],
        chat_request: Mapping[str, Any] | bytes,
        *,
        min_interval: float = 0.05,
        logprobs: StreamLogprobs | None = None,
        ids_json: bytes | None = None,
        include_stop_str: bool = False,
        budget: int | None = None,
        head: int = 0,
    ) -> None:
        self._transport = transport
        # The chat route never decodes the token a generation stopped on: the last chunk goes
        # to derender without it (`StopTokenStrip`).
        self._strip = StopTokenStrip(include_stop_str)
        self._generate = generate
        # Resent on every derender call (vLLM keeps no state): encoded once (`ids_json`: the
        # prompt ids already encoded, as generate got them).
        self._tail = derender_tail(prompt_ids, chat_request, ids_json=ids_json)
        self._stream = GenerateStream()
        self._head = head
        # A first call: the tail, the head, and an event of a few tokens.
        first = len(self._tail) + head + _FIRST_CHUNK
        self._coalescer = DerenderCoalescer(min_interval, budget, first)
        #: Whether the client gets logprobs (the calls send them only then).
        self._wants_logprobs = logprobs is not None
        self._arrived = asyncio.Event()
        self._read_done = False
        self._logprobs = logprobs
        #: Whether this server's streamed derender was seen to leave logprobs null.
        self._unresolved = False
        self.resolves = 0
        self.generated: Generated | None = None

    @property
    def so_far(self) -> Generated | None:
        """The generation read so far (ids, logprobs, ...), None before its first event."""
        return self._stream.generated

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

    async def _post(self, body: bytes) -> bytes:
        self._coalescer.spend(len(body) + self._head)
        return await post_derender(self._transport, body)

    async def _derender(self, chunk: bytes, state: Any, resolved: bool = False) -> dict[str, Any]:
        strip = self._strip
        # Logprobs go only when the client gets them, and not when this server's streamed
        # derender leaves them null, or the stream ended (`resolved`: a resolving call made
        # with this one carries them).
        logprobs = self._wants_logprobs and not self._unresolved and not resolved
        sent = derender_generate_answer(strip.strip(chunk), logprobs=logprobs)
        body = derender_chunk_body(sent, state, self._tail)
        answer = read_derender(await self._post(body))
        strip.restore(answer)
        return answer

    async def _derender_with_logprobs(self, chunk: bytes, state: Any) -> dict[str, Any]:
        """The chunk's derender answer, its logprobs resolved by a unary call made at the same
        time when derender leaves them null (module docs)."""
        resolver = self._logprobs
        body = resolver.request(chunk) if resolver is not None else None
        if resolver is None or body is None:
            return await self._derender(chunk, state)
        self.resolves += 1
        # Whether this server's streamed derender resolves logprobs itself is learnt from a call
        # that carries them as well as the resolving call; the stream's last call (all of it,
        # when the byte bound held it to its end) sends them only once.
        last = self._coalescer.closed  # only the usage event may follow
        streamed = asyncio.ensure_future(self._derender(chunk, state, resolved=last))
        resolved = asyncio.ensure_future(self._post(body))
        answer: dict[str, Any]
        try:
            answer, raw = await asyncio.gather(streamed, resolved)
        except BaseException:
            streamed.cancel()
            resolved.cancel()
            raise
        logprobs = resolver.read(raw)
        choices = (answer.get("chunk") or {}).get("choices") or ()
        for choice in choices:
            if choice.get("logprobs") is None:
                choice["logprobs"] = logprobs
                self._unresolved = True
            else:
                self._logprobs = None  # this server's streamed derender resolves them itself
        return answer

    async def events(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(self._read())
        state: Any = None
        last: dict[str, Any] | None = None
        try:
            while True:
                usage = self._coalescer.take_usage(loop.time()) if last is not None else None
                if usage is not None:
                    assert last is not None
                    # The usage chunk is the previous chunk's fields and generate's counts: no
                    # derender call (one round trip less at the end of every stream).
                    built = usage_chunk(last, usage)
                    if built is None:
                        self._coalescer.calls += 1
                        built = (await self._derender(usage, state))["chunk"]
                    yield b"data: " + orjson.dumps(built) + b"\n\n"
                    continue
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
                answer = await self._derender_with_logprobs(chunk, state)
                self._coalescer.finished()
                state = answer.get("stream_state")
                last = answer["chunk"]
                yield b"data: " + orjson.dumps(last) + b"\n\n"
            await reader  # raises what the generate stream raised
            yield _DONE
        finally:
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
