"""POST /v1/chat/completions: the captured route, streamed and not.

The request path decodes the body once, normalizes and validates it, admits the call, and sends
it upstream with the token fields capture needs. The answer is relayed without the fields the
client did not ask for; the record is staged before the client learns the call is over (the
``X-Capture-Status`` header, or for streams the ``: capture-status`` comment before ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from .adapters.vllm import (
    CaptureExtractionError,
    ForwardPlan,
    UpstreamProtocolError,
    parse_error_body,
)
from .capture import Call, sampling_of
from .errors import (
    BadRequest,
    CaptureUnavailable,
    PayloadTooLarge,
    ProxyError,
    Unprocessable,
    UpstreamFailed,
)
from .identity import resolve_rollout_id
from .normalize import NormalizedRequest, normalize_request
from .schemas.records import CallStatus, StageResult
from .schemas.request import RequestValidationError

if TYPE_CHECKING:
    from .state import ProxyState

__all__ = ["chat_completions"]

log = logging.getLogger("capture_proxy.chat")
_JSON = "application/json"


#: Bodies above this are decoded and normalized on a worker thread: base64-decoding a large
#: image would otherwise stall every other call on the event loop.
_OFFLOAD_BYTES = 1 << 20


async def _read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        # Refused from the header, before a byte of the body is read.
        raise PayloadTooLarge(
            f"request body of {length} bytes is over the limit of {limit} bytes",
            code="body_too_large",
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(
            f"request body is over the limit of {limit} bytes", code="body_too_large"
        ) from None


def _decode_and_normalize(raw: bytes, allow_remote_media: bool) -> NormalizedRequest:
    """The one JSON decode of the body, then normalization and strict validation."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
    try:
        return normalize_request(data, allow_remote_media=allow_remote_media)
    except RequestValidationError as e:
        err = PayloadTooLarge if e.status == 413 else Unprocessable
        raise err(e.message, code=e.code, param=e.param) from None


async def _guard_context(state: ProxyState, body: dict[str, Any], staged: dict[str, Any]) -> None:
    """With --max-model-len: refuse (or cap) a call whose prompt + max_tokens cannot fit."""
    limit = state.settings.max_model_len
    if not limit:
        return
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    wanted = body.get(key)
    prompt_len = await state.upstream.count_prompt_tokens(body)
    room = limit - prompt_len
    if room <= 0:
        raise BadRequest(
            f"the prompt is {prompt_len} tokens: it does not fit the context window of {limit}",
            code="context_overflow",
            param="messages",
        )
    if wanted is None or wanted <= room:
        if wanted is None and state.settings.context_overflow == "cap":
            body[key] = staged[key] = room
        return
    if state.settings.context_overflow == "cap":
        body[key] = staged[key] = room
        return
    raise BadRequest(
        f"{key}={wanted} plus the prompt's {prompt_len} tokens exceeds the context window of "
        f"{limit}; ask for at most {room}",
        code="context_overflow",
        param=key,
    )


def _capture_headers(call_id: str, status: str) -> dict[str, str]:
    return {"X-Capture-Call-Id": call_id, "X-Capture-Status": status}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    from .state import STATE

    state = request.app[STATE]
    started = time.perf_counter()
    rollout_id = resolve_rollout_id(request, require=state.settings.require_rollout_id)
    state.authorize_call(request, rollout_id)
    try:
        raw = await _read_body(request, state.settings.max_body_bytes)
        remote = state.settings.allow_remote_media
        if len(raw) > _OFFLOAD_BYTES:
            normalized = await asyncio.to_thread(_decode_and_normalize, raw, remote)
        else:
            normalized = _decode_and_normalize(raw, remote)
        live = await state.capture.ensure_rollout(rollout_id)
        policy = state.capture.policy
        body = policy.apply(normalized.body, live.policy)
        staged = policy.apply(normalized.staged, live.policy)
        await _guard_context(state, body, staged)
        call = state.capture.begin_call(rollout_id, staged, normalized.attachments)
    except ProxyError as e:
        if e.status != 409:  # a sealed rollout's ledger is closed
            call_id = await state.capture.reject(rollout_id, e.code, e.message, e.status)
            e.headers.update(_capture_headers(call_id, CallStatus.REJECTED))
        state.metrics.calls.labels(CallStatus.REJECTED, e.code).inc()
        raise
    try:
        info = await state.upstream.info(str(body.get("model", "")))
        plan = state.adapter(info.reasoning_field).plan(body)
        if plan.wants.stream:
            return await _stream(state, request, call, plan, body, info, started)
        return await _unary(state, call, plan, body, info, started)
    except asyncio.CancelledError:
        # The client went away: the upstream request was closed on the way out (vLLM aborts
        # the generation); record the abort even though this task is being cancelled.
        if not call.finished:
            state.spawn(
                state.capture.fail_call(
                    call,
                    CallStatus.ABORTED,
                    "client_disconnected",
                    "the client closed the connection before the answer was complete",
                )
            )
            state.metrics.calls.labels(CallStatus.ABORTED, "client_disconnected").inc()
        raise
    finally:
        if not call.finished and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
            # Defensive: every path above completes or fails the call; never leave it pending.
            await state.capture.fail_call(call, CallStatus.UPSTREAM_ERROR, "internal", "unfinished")


async def _send_upstream(state: ProxyState, plan: ForwardPlan) -> aiohttp.ClientResponse:
    s = state.settings
    try:
        async with asyncio.timeout(s.upstream_first_byte_timeout):
            return await state.session.post(
                state.upstream.url("/v1/chat/completions"),
                data=plan.body,
                headers={**state.upstream.headers, "Content-Type": _JSON},
            )
    except TimeoutError:
        raise UpstreamFailed(
            f"the upstream sent no response within {s.upstream_first_byte_timeout:g}s",
            code="upstream_timeout",
            status=504,
        ) from None
    except aiohttp.ClientError as e:
        state.upstream.mark_stale()
        raise UpstreamFailed(
            f"cannot reach the upstream: {type(e).__name__}: {e}", code="upstream_unreachable"
        ) from None


async def _upstream_error(
    state: ProxyState, call: Call, resp: aiohttp.ClientResponse
) -> web.Response:
    """Relay an upstream error answer (OpenAI error body) and record it."""
    raw = await resp.read()
    err = parse_error_body(raw, resp.status)
    message = str(err.get("error", {}).get("message", ""))[:500]
    await state.capture.fail_call(
        call, CallStatus.UPSTREAM_ERROR, f"upstream_{resp.status}", message, resp.status
    )
    state.metrics.calls.labels(CallStatus.UPSTREAM_ERROR, f"upstream_{resp.status}").inc()
    return web.Response(
        status=resp.status,
        body=orjson.dumps(err),
        content_type=_JSON,
        headers=_capture_headers(call.call_id, CallStatus.UPSTREAM_ERROR),
    )


async def _fail_upstream(
    state: ProxyState, call: Call, e: ProxyError | UpstreamProtocolError
) -> None:
    reason = e.code if isinstance(e, ProxyError) else e.reason
    message = e.message
    status = e.status if isinstance(e, ProxyError) else 502
    await state.capture.fail_call(call, CallStatus.UPSTREAM_ERROR, reason, message, status)
    state.metrics.calls.labels(CallStatus.UPSTREAM_ERROR, reason).inc()


def _record_outcome(state: ProxyState, result: StageResult) -> None:
    if result.status is CallStatus.STAGED and result.coords is not None:
        state.metrics.calls.labels(CallStatus.STAGED, "ok").inc()
        state.metrics.staged_records.inc()
        state.metrics.staged_tokens.inc(result.coords.cum_len)
        state.metrics.staged_token_bytes.inc(4 * result.coords.delta_len)
    else:
        state.metrics.calls.labels(CallStatus.CAPTURE_FAILED, result.reason or "").inc()


async def _complete(
    state: ProxyState, call: Call, completion: Any, body: dict[str, Any], info: Any
) -> StageResult:
    t = time.perf_counter()
    result = await state.capture.complete_call(
        call,
        completion,
        model=str(body.get("model", "")),
        upstream_version=info.version,
        tokenizer_fingerprint=info.fingerprint,
        sampling=sampling_of(body),
    )
    state.metrics.stage_seconds.observe(time.perf_counter() - t)
    if call.attachments:
        state.metrics.attachments.inc(len(call.attachments))
    _record_outcome(state, result)
    return result


async def _unary(
    state: ProxyState,
    call: Call,
    plan: ForwardPlan,
    body: dict[str, Any],
    info: Any,
    started: float,
) -> web.StreamResponse:
    t_up = time.perf_counter()
    try:
        resp = await _send_upstream(state, plan)
    except UpstreamFailed as e:
        await _fail_upstream(state, call, e)
        e.headers.update(_capture_headers(call.call_id, CallStatus.UPSTREAM_ERROR))
        raise
    async with resp:
        if resp.status != 200:
            return await _upstream_error(state, call, resp)
        try:
            async with asyncio.timeout(state.settings.upstream_idle_timeout):
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            err = UpstreamFailed(
                f"the upstream answer broke off: {type(e).__name__}: {e}", code="upstream_broken"
            )
            await _fail_upstream(state, call, err)
            err.headers.update(_capture_headers(call.call_id, CallStatus.UPSTREAM_ERROR))
            raise err from None
    upstream_elapsed = time.perf_counter() - t_up
    state.metrics.upstream_seconds.observe(upstream_elapsed)
    try:
        completion, client_body = state.adapter(info.reasoning_field).parse_response(raw, plan)
    except UpstreamProtocolError as e:
        await _fail_upstream(state, call, e)
        err = UpstreamFailed(f"the upstream answer is malformed: {e.message}", code=e.reason)
        err.headers.update(_capture_headers(call.call_id, CallStatus.UPSTREAM_ERROR))
        raise err from None
    except CaptureExtractionError as e:
        result = StageResult.failed(e.reason, e.message)
        await state.capture.fail_call(call, CallStatus.CAPTURE_FAILED, e.reason, e.message)
        _record_outcome(state, result)
        return _capture_failed_response(state, call, e.client_body or raw, result)
    result = await _complete(state, call, completion, body, info)
    if result.status is not CallStatus.STAGED:
        return _capture_failed_response(state, call, client_body, result)
    state.metrics.overhead_seconds.observe(
        max(0.0, time.perf_counter() - started - upstream_elapsed)
    )
    return web.Response(
        body=client_body,
        content_type=_JSON,
        headers=_capture_headers(call.call_id, CallStatus.STAGED),
    )


def _capture_failed_response(
    state: ProxyState, call: Call, client_body: bytes, result: StageResult
) -> web.Response:
    if state.settings.on_capture_failure == "error":
        err = CaptureUnavailable(
            f"the answer could not be staged ({result.reason}: {result.message}); "
            "the proxy runs with --on-capture-failure=error",
            code="capture_failed",
        )
        return web.Response(
            status=err.status,
            body=err.body(),
            content_type=_JSON,
            headers=_capture_headers(call.call_id, CallStatus.CAPTURE_FAILED),
        )
    return web.Response(
        body=client_body,
        content_type=_JSON,
        headers=_capture_headers(call.call_id, CallStatus.CAPTURE_FAILED),
    )


def _sse_error(message: str, code: str, type: str = "upstream_error") -> bytes:
    return (
        b"data: "
        + orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
        + b"\n\n"
    )


async def _stream(
    state: ProxyState,
    request: web.Request,
    call: Call,
    plan: ForwardPlan,
    body: dict[str, Any],
    info: Any,
    started: float,
) -> web.StreamResponse:
    try:
        resp = await _send_upstream(state, plan)
    except UpstreamFailed as e:
        await _fail_upstream(state, call, e)
        e.headers.update(_capture_headers(call.call_id, CallStatus.UPSTREAM_ERROR))
        raise
    async with resp:
        if resp.status != 200:
            return await _upstream_error(state, call, resp)
        out = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **_capture_headers(call.call_id, "pending"),
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
    acc = state.adapter(info.reasoning_field).stream(plan)
    idle = state.settings.upstream_idle_timeout
    try:
        while True:
            async with asyncio.timeout(idle):
                chunk = await resp.content.readany()
            if not chunk:
                break
            events = acc.feed(chunk)
            if events:
                await out.write(b"".join(events))
    except TimeoutError:
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
    try:
        completion = acc.finish()
    except UpstreamProtocolError as e:
        return await _end_stream_broken(state, call, out, e.reason, e.message)
    except CaptureExtractionError as e:
        await state.capture.fail_call(call, CallStatus.CAPTURE_FAILED, e.reason, e.message)
        result = StageResult.failed(e.reason, e.message)
        _record_outcome(state, result)
        return await _end_stream_outcome(state, call, out, result)
    result = await _complete(state, call, completion, body, info)
    return await _end_stream_outcome(state, call, out, result)


async def _end_stream_broken(
    state: ProxyState, call: Call, out: web.StreamResponse, reason: str, message: str
) -> web.StreamResponse:
    """A broken upstream stream is never completed for the client: an error event, no [DONE]."""
    await state.capture.fail_call(call, CallStatus.UPSTREAM_ERROR, reason, message, 502)
    state.metrics.calls.labels(CallStatus.UPSTREAM_ERROR, reason).inc()
    try:
        await out.write(_sse_error(message, reason))
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
                _sse_error(
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
