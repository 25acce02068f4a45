"""POST /v1/chat/completions: the captured route, as HTTP around one `Exchange`.

The handler does only HTTP work: read the body, hand it to the exchange, and turn its outcome into
a status, headers (``X-Capture-Status``, ``X-Capture-Call-Id``) and a body — or, for a stream,
relay the bytes the exchange yields and close with ``: capture-status <outcome> call_id=...`` and
``data: [DONE]``, or with an SSE error event and no ``[DONE]`` when the answer is not whole (so no
client mistakes a cut-off answer for a complete one; docs/architecture.md has the whole flow).
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from aiohttp import web

from ..core.exchange import Exchange
from ..core.pipeline import Outcome
from ..errors import (
    CaptureUnavailable,
    PayloadTooLarge,
    ProxyError,
    RequestTimeout,
    TooManyRequests,
    UnsupportedMediaType,
    UpstreamFailed,
)
from ..schemas.records import CallStatus
from ..schemas.request import count_body_items, too_many_body_items
from .identity import resolve_rollout_id
from .state import STATE, ProxyState
from .validation import answer_for

__all__ = ["capture_headers", "chat_completions", "sse_error"]

log = logging.getLogger("capture_proxy.chat")

JSON = "application/json"


def capture_headers(call_id: str, status: str) -> dict[str, str]:
    return {"X-Capture-Call-Id": call_id, "X-Capture-Status": status}


def sse_error(message: str, code: str, type: str = "upstream_error") -> bytes:
    error = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return b"data: " + orjson.dumps(error) + b"\n\n"


async def _read_body(request: web.Request, limit: int, within: float, max_items: int) -> bytes:
    """The request's body, refused over `limit` bytes (413), over `max_items` JSON values
    (413 ``json_too_many_items``, counted as it arrives: `count_body_items`) or when it takes
    longer than `within` seconds to arrive (408, ``--client-body-timeout``: a client trickling
    its body must not hold a connection and a call forever).

    A body refused part-way is not received further: its connection is closed once the answer
    is written (`_unread_rest`)."""
    length = request.content_length
    if length is not None and length > limit:
        # Refused from the header, before a byte of the body is read.
        raise PayloadTooLarge(
            f"request body of {length} bytes is over the limit of {limit} bytes",
            code="body_too_large",
        )
    # Read chunk by chunk as they arrive, joined once: aiohttp's `request.read()` raises its read
    # size to the whole body limit and copies a large body into a growing bytearray and then
    # into bytes on the event loop, ~100 ms of loop time for a 62 MiB body (measured with
    # py-spy beside bench/bench_big_body.py): three at once stalled every other call.
    chunks: list[bytes] = []
    size = 0
    items = 0
    try:
        async with asyncio.timeout(within):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise _unread_rest(
                        request,
                        PayloadTooLarge(
                            f"request body is over the limit of {limit} bytes",
                            code="body_too_large",
                        ),
                    )
                # ~2 ns a byte: a body of 22 million `{}` is refused after its first 800 KB,
                # where reading it whole and counting it after cost ~120 ms of the proxy's CPU
                # (bench/bench_hostile_cost.py).
                items += count_body_items(chunk)
                if items > max_items:
                    raise _unread_rest(request, answer_for(too_many_body_items(max_items)))
                chunks.append(chunk)
    except TimeoutError as e:
        raise _unread_rest(
            request,
            RequestTimeout(
                f"the request body did not arrive within {within:g}s (--client-body-timeout)",
                code="body_timeout",
            ),
        ) from e
    if len(chunks) == 1:
        return chunks[0]
    if size > _JOIN_ON_THREAD:
        return await asyncio.to_thread(b"".join, chunks)
    return b"".join(chunks)


def _unread_rest(request: web.Request, err: ProxyError) -> ProxyError:
    """`err`, for a refused body not received whole: no more of it is received, and the
    connection is closed after the answer (said in ``Connection: close``).

    Left to itself, aiohttp would receive the rest and parse it to discard it (~1.6 ms of the
    proxy's CPU per MiB): most of what a huge body cost. Instead reading stops (the kernel's
    flow control holds the client back) and aiohttp closes the connection a second after the
    answer (``server.run``'s lingering time). A client that reads while it sends, or whose
    body's rest fits the socket buffers, reads the answer; one that sends a large rest before
    reading sees the connection close, as it would at a body limit anywhere."""
    request.protocol.close()  # what still arrives is dropped unparsed
    transport = request.transport
    if transport is not None:
        transport.pause_reading()
    err.headers["Connection"] = "close"
    return err


#: Refusals after which the client's connection is closed (see `chat_completions`).
_CLOSE_AFTER = frozenset({"too_many_inflight_rollout", "rollout_over_fair_share"})

#: A body refused before it is read is read anyway (to keep the connection) up to this size;
#: a larger one is not received (`_unread_rest`).
_UNREAD_CLOSE_BYTES = 8 << 20

#: Bodies joined from their chunks on a worker thread above this size (the copy, and the first
#: touch of its pages, take ~30 ms per 64 MiB).
_JOIN_ON_THREAD = 1 << 20


def _check_body_rate(request: web.Request, state: ProxyState, rollout_id: str) -> None:
    """429 before a byte of the body is read, for a rollout over ``--max-rollout-body-rate``."""
    length = request.content_length
    wait = state.body_rate.take(rollout_id, length) if length is not None else None
    if wait is None:
        return
    err = TooManyRequests(
        f"rollout {rollout_id} is sending request bodies faster than "
        f"{state.body_rate.rate / 2**20:g} MiB/s (--max-rollout-body-rate): this body of "
        f"{length} bytes fits in {wait} s",
        code="rollout_body_rate",
        headers={"Retry-After": str(wait)},
    )
    if length is not None and length > _UNREAD_CLOSE_BYTES:
        # Not received to be discarded (aiohttp would parse all of it to keep the connection):
        # answered, and the connection closed.
        raise _unread_rest(request, err)
    raise err


def _check_json(request: web.Request) -> None:
    """Only JSON bodies: a web page in an operator's browser may post a form or text/plain to
    any address without asking first (no CORS preflight), but never ``application/json``."""
    given = request.headers.get("Content-Type")
    if request.content_type != JSON or given is None:
        shown = (given or "none")[:100]
        raise UnsupportedMediaType(
            f"the chat route takes Content-Type: application/json (a charset may follow), "
            f"got {shown!r}",
            code="unsupported_media_type",
        )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    rollout_id = resolve_rollout_id(request, require=state.settings.require_rollout_id)
    await state.authorize_call(request, rollout_id)
    exchange = state.pipeline.exchange(rollout_id)
    #: The stream response once its headers went out (a cut call then ends with an SSE error).
    opened: list[web.StreamResponse] = []
    #: Whether the call holds a fair turn (``--fair-share-inflight``), given back at the end.
    turned = False
    try:
        try:
            try:
                _check_json(request)
                # Before the body is read: a call waiting its turn holds its connection only.
                await state.fair_share.turn(rollout_id)
                turned = True
                live = state.capture.rollouts.get(rollout_id)
                if live is not None:  # as admission would refuse it, without its body
                    state.capture.check_rollout_inflight(live)
                _check_body_rate(request, state, rollout_id)
                settings = state.settings
                body = await _read_body(
                    request,
                    settings.max_body_bytes,
                    settings.client_body_timeout,
                    settings.max_json_items,
                )
                if request.content_length is None:
                    state.body_rate.charge(rollout_id, len(body))
            except ProxyError as e:
                await exchange.refuse(e)
                raise
            # The exchange owns the raw body from here and lets it go once decoded: an image
            # session's body is tens of MiB, held otherwise until the answer is relayed.
            preparing = exchange.prepare(body, items_counted=True)
            del body
            await preparing
        except ProxyError as e:
            if exchange.outcome is not None:
                e.headers.update(capture_headers(exchange.outcome.call_id, CallStatus.REJECTED))
            if e.code in _CLOSE_AFTER:
                # A sandbox over its rollout's in-flight limit is sending calls faster than
                # they are answered (an agent makes one at a time): its next call comes on a new
                # connection, which its address's rate (--max-connection-rate-per-address)
                # judges at accept, before a byte of it is parsed. Keep-alive would let it
                # send without end on the connections it holds, each call parsed and refused.
                # Its body, unread, is dropped as it arrives (`_unread_rest`).
                _unread_rest(request, e)
            raise
        try:
            upstream_error = await exchange.send()
            if upstream_error is not None:
                return _unary_response(state, upstream_error)
            if exchange.streamed:
                return await _stream(state, request, exchange, opened)
            outcome = await exchange.read_unary()
        except UpstreamFailed as e:  # recorded by the exchange; the client gets it
            e.headers.update(capture_headers(exchange.admitted.call_id, CallStatus.UPSTREAM_ERROR))
            raise
        return _unary_response(state, outcome)
    except asyncio.CancelledError:
        # The client went away, the shutdown deadline passed, or a weight-update pause cut the
        # call: record the abort even though this task is being cancelled (closing the
        # upstream request makes vLLM abort). A cut call's client still gets an answer.
        cut = exchange.call.cut if exchange.call is not None else None
        if state.shutting_down:
            reason, why = "shutdown", "the proxy shut down before the answer was complete"
        elif cut is not None:
            reason = cut
            why = "a weight-update pause cut the call at its deadline (--pause-drain-timeout)"
        else:
            reason = "client_disconnected"
            why = "the client closed the connection before the answer was complete"
        task = asyncio.current_task()
        # uncancel() last: only a cut's cancellation is taken back, and only when it is the
        # sole one (the client is still there to be answered).
        if cut is not None and not state.shutting_down and task and task.uncancel() == 0:
            await exchange.abort(reason, why)
            return await _cut_answer(state, request, exchange, opened)
        state.pipeline.spawn(exchange.abort(reason, why))
        raise
    finally:
        if turned:
            state.fair_share.release(rollout_id)
        if not exchange.finished and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
            # Defensive: every path above ends the call; never leave it pending.
            await exchange.abort("internal", "the call ended without an outcome")


async def _cut_answer(
    state: ProxyState, request: web.Request, exchange: Exchange, opened: list[web.StreamResponse]
) -> web.StreamResponse:
    """What a call cut by a weight-update pause answers its client: 503 ``weights_paused``
    with ``Retry-After`` (the client's retry goes to the updated weights), or, for a stream
    whose headers went out already, that error as its last SSE event. Never a dropped
    connection: a client cannot tell that from a crash."""
    call_id = exchange.call.call_id if exchange.call is not None else ""
    err = CaptureUnavailable(
        "a weight-update pause cut the call at its deadline (--pause-drain-timeout); it was "
        "not answered and is recorded aborted: retry it once the proxy resumes",
        code="weights_paused",
        headers={"Retry-After": "5"},
    )
    if not opened:
        return web.Response(
            status=err.status,
            body=err.body(),
            content_type=JSON,
            headers={**err.headers, **capture_headers(call_id, CallStatus.ABORTED)},
        )
    out = opened[0]
    tail = sse_error(err.message, err.code, err.type)
    try:
        if not await _write_within(
            request, out, tail, state.settings.client_write_timeout, last=True
        ):
            _drop(request)
    except ConnectionResetError:
        pass  # the call is recorded either way; the client is gone
    return out


def _unary_response(state: ProxyState, outcome: Outcome) -> web.Response:
    headers = capture_headers(outcome.call_id, outcome.status)
    if outcome.status is CallStatus.CAPTURE_FAILED and state.settings.on_capture_failure == "error":
        err = CaptureUnavailable(
            f"the answer could not be staged ({outcome.reason}: {outcome.message}); "
            "the proxy runs with --on-capture-failure=error",
            code="capture_failed",
        )
        return web.Response(status=err.status, body=err.body(), content_type=JSON, headers=headers)
    return web.Response(
        status=outcome.http_status, body=outcome.body, content_type=JSON, headers=headers
    )


async def _stream(
    state: ProxyState,
    request: web.Request,
    exchange: Exchange,
    opened: list[web.StreamResponse],
) -> web.StreamResponse:
    call = exchange.admitted
    out = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            **capture_headers(call.call_id, "pending"),
        }
    )
    await out.prepare(request)
    opened.append(out)
    state.metrics.streams_open.inc()
    pieces = exchange.relay_stream()
    deadline = state.settings.client_write_timeout
    try:
        try:
            async for piece in pieces:
                if not await _write_within(request, out, piece, deadline):
                    # Without this, a client that stops reading would pin the call, the
                    # upstream request and the connection for as long as it liked.
                    await pieces.aclose()
                    await exchange.abort(
                        "client_stalled",
                        f"the client read nothing of its stream for {deadline:g}s "
                        "(--client-write-timeout); the proxy closed the connection",
                    )
                    _drop(request)
                    return out
        except ConnectionResetError:
            await pieces.aclose()
            await exchange.abort(
                "client_disconnected", "the client closed the connection mid-stream"
            )
            return out
        await _stream_tail(state, request, out, exchange.outcome)
        return out
    finally:
        state.metrics.streams_open.dec()


async def _write_within(
    request: web.Request,
    out: web.StreamResponse,
    data: bytes,
    seconds: float,
    *,
    last: bool = False,
) -> bool:
    """Write `data` (and end the response if `last`); False when the client has not made room
    for it within `seconds`.

    A write waits only while the connection's buffers are full, so one that waits that long
    means the client stopped reading. A client that reads keeps the transport's buffer below
    its low-water mark, and then the write cannot wait: it goes without a timer (arming one
    costs about 9 µs, for every piece of every stream).
    """
    transport = request.transport
    if transport is not None and not last:
        low, _ = transport.get_write_buffer_limits()
        if transport.get_write_buffer_size() + len(data) <= low:
            await out.write(data)
            return True
    try:
        async with asyncio.timeout(seconds):
            await out.write(data)
            if last:
                await out.write_eof()
    except TimeoutError:
        return False
    return True


def _drop(request: web.Request) -> None:
    """Close the client's connection without sending what is still buffered for it."""
    if request.transport is not None:
        request.transport.abort()


async def _stream_tail(
    state: ProxyState, request: web.Request, out: web.StreamResponse, outcome: Outcome | None
) -> None:
    """How a stream ends: its capture status and ``[DONE]``, or an SSE error event."""
    assert outcome is not None
    if outcome.status is CallStatus.STAGED:
        tail = f": capture-status staged call_id={outcome.call_id}\n\ndata: [DONE]\n\n".encode()
    elif outcome.status is CallStatus.CAPTURE_FAILED:
        if state.settings.on_capture_failure == "error":
            tail = sse_error(
                f"the answer could not be staged ({outcome.reason}: {outcome.message})",
                "capture_failed",
                "capture_unavailable",
            )
        else:
            status = f": capture-status capture_failed call_id={outcome.call_id}\n\n"
            tail = status.encode() + b"data: [DONE]\n\n"
    else:
        # The upstream broke or stalled: never complete the stream for the client.
        tail = sse_error(outcome.message, outcome.reason)
    try:
        if not await _write_within(
            request, out, tail, state.settings.client_write_timeout, last=True
        ):
            _drop(request)  # the outcome is recorded either way; the client stopped reading
    except ConnectionResetError:
        pass  # the outcome is recorded either way; the client is gone
