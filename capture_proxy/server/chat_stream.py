"""The streamed half of the chat route: relay chunks as they arrive, then stage, then finish.

Headers go out first (``X-Capture-Status: pending``); each upstream chunk is relayed as soon as it
arrives, minus the fields the client did not ask for; at the end the record is staged and the
stream closes with ``: capture-status <outcome> call_id=...`` and ``data: [DONE]`` — or, when the
upstream broke, with an SSE error event and no ``[DONE]``, so no client mistakes a cut-off answer
for a whole one (docs/contract.md, "Failure semantics").
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from ..adapters.vllm import CaptureExtractionError, ForwardPlan, UpstreamProtocolError
from ..core.capture import Call
from ..schemas.records import CallStatus, StageResult
from .forward import (
    capture_headers,
    complete,
    record_outcome,
    relay_upstream_error,
    send_upstream,
    sse_error,
)

if TYPE_CHECKING:
    from .state import ProxyState

__all__ = ["stream_call"]


async def stream_call(
    state: ProxyState,
    request: web.Request,
    call: Call,
    plan: ForwardPlan,
    body: dict[str, Any],
    info: Any,
    started: float,
) -> web.StreamResponse:
    resp = await send_upstream(state, call, plan)
    async with resp:
        if resp.status != 200:
            return await relay_upstream_error(state, call, resp)
        out = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **capture_headers(call.call_id, "pending"),
            }
        )
        await out.prepare(request)
        state.metrics.streams_open.inc()
        try:
            return await _relay(state, call, plan, body, info, resp, out)
        finally:
            state.metrics.streams_open.dec()


async def _relay(
    state: ProxyState,
    call: Call,
    plan: ForwardPlan,
    body: dict[str, Any],
    info: Any,
    resp: aiohttp.ClientResponse,
    out: web.StreamResponse,
) -> web.StreamResponse:
    acc = state.adapter(info.reasoning_field).stream(plan, session=call.rollout_id)
    idle = state.settings.upstream_idle_timeout
    loop = asyncio.get_running_loop()
    watch = _IdleWatch(resp, idle)
    try:
        while True:
            watch.waiting_since = loop.time()
            chunk = await resp.content.readany()
            watch.waiting_since = None
            if not chunk:
                break
            events = acc.feed(chunk)
            if events:
                await out.write(b"".join(events))
    except (_UpstreamIdle, TimeoutError):
        resp.close()
        return await _end_stream_broken(
            state,
            call,
            out,
            "upstream_idle_timeout",
            f"the upstream sent nothing for {idle:g}s mid-stream",
        )
    except aiohttp.ClientError as e:
        return await _end_stream_broken(
            state,
            call,
            out,
            "upstream_broken",
            f"the upstream stream broke: {type(e).__name__}: {e}",
        )
    except ConnectionResetError:
        resp.close()
        await state.capture.fail_call(
            call,
            CallStatus.ABORTED,
            "client_disconnected",
            "the client closed the connection mid-stream",
        )
        state.metrics.calls.labels(CallStatus.ABORTED, "client_disconnected").inc()
        return out
    finally:
        watch.stop()
    try:
        completion = acc.finish()
    except UpstreamProtocolError as e:
        return await _end_stream_broken(state, call, out, e.reason, e.message)
    except CaptureExtractionError as e:
        await state.capture.fail_call(call, CallStatus.CAPTURE_FAILED, e.reason, e.message)
        result = StageResult.failed(e.reason, e.message)
        record_outcome(state, result)
        return await _end_stream_outcome(state, call, out, result)
    result = await complete(state, call, completion, body, info)
    return await _end_stream_outcome(state, call, out, result)


class _UpstreamIdle(Exception):
    """Set on the upstream body by `_IdleWatch`: a read waited longer than the idle timeout."""


class _IdleWatch:
    """``--upstream-idle-timeout`` for the reads of one stream, without a timer per chunk.

    ``asyncio.timeout()`` around each read schedules and cancels a timer per chunk: ~10 µs, a
    third of what relaying a token chunk costs. Here a read only records when it started
    (`waiting_since`, None between reads: writing to the client does not count), and one timer
    wakes when the current read would be due and fails it by setting `_UpstreamIdle` on the
    response body, which `readany` then raises.
    """

    def __init__(self, resp: aiohttp.ClientResponse, idle: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._resp = resp
        self._idle = idle
        self.waiting_since: float | None = None
        self._handle = self._loop.call_later(idle, self._check)

    def _check(self) -> None:
        since = self.waiting_since
        now = self._loop.time()
        if since is not None and now - since >= self._idle:
            self._resp.content.set_exception(_UpstreamIdle())
            return
        self._handle = self._loop.call_at(
            (now if since is None else since) + self._idle, self._check
        )

    def stop(self) -> None:
        self._handle.cancel()


async def _end_stream_broken(
    state: ProxyState, call: Call, out: web.StreamResponse, reason: str, message: str
) -> web.StreamResponse:
    """A broken upstream stream is never completed for the client: an error event, no [DONE]."""
    await state.capture.fail_call(call, CallStatus.UPSTREAM_ERROR, reason, message, 502)
    state.metrics.calls.labels(CallStatus.UPSTREAM_ERROR, reason).inc()
    try:
        await out.write(sse_error(message, reason))
        await out.write_eof()
    except ConnectionResetError:
        pass
    return out


async def _end_stream_outcome(
    state: ProxyState, call: Call, out: web.StreamResponse, result: StageResult
) -> web.StreamResponse:
    try:
        if result.status is CallStatus.STAGED:
            await out.write(
                f": capture-status staged call_id={call.call_id}\n\ndata: [DONE]\n\n".encode()
            )
        elif state.settings.on_capture_failure == "error":
            await out.write(
                sse_error(
                    f"the answer could not be staged ({result.reason}: {result.message})",
                    "capture_failed",
                    "capture_unavailable",
                )
            )
        else:
            status = f": capture-status capture_failed call_id={call.call_id}\n\n"
            await out.write(status.encode() + b"data: [DONE]\n\n")
        await out.write_eof()
    except ConnectionResetError:
        pass  # staged or not, the outcome is recorded; the client is gone
    return out
