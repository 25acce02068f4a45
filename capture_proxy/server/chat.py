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

from ..adapters.vllm import (
    CaptureExtractionError,
    ForwardPlan,
    UpstreamProtocolError,
)
from ..core.capture import Call
from ..core.normalize import NormalizedRequest, normalize_request
from ..errors import (
    BadRequest,
    CaptureUnavailable,
    PayloadTooLarge,
    ProxyError,
    Unprocessable,
    UpstreamFailed,
)
from ..schemas.records import CallStatus, StageResult
from ..schemas.request import FreeJsonLimits, RequestValidationError, check_free_json_limits
from .chat_stream import stream_call
from .forward import (
    JSON,
    capture_headers,
    complete,
    fail_and_raise,
    record_outcome,
    relay_upstream_error,
    send_upstream,
)
from .identity import resolve_rollout_id

if TYPE_CHECKING:
    from .state import ProxyState

__all__ = ["chat_completions"]

log = logging.getLogger("capture_proxy.chat")


#: Bodies above this are decoded and normalized, and their request key and digest computed, on
#: a worker thread: base64-decoding a large image or walking large JSON would otherwise stall
#: every other call on the event loop.
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


def _decode_and_normalize(
    raw: bytes, allow_remote_media: bool, free_json: FreeJsonLimits
) -> NormalizedRequest:
    """The one JSON decode of the body, then normalization and strict validation.

    Free-form values are bounded on the raw body first: a hostile one is refused before the
    decode builds ~30 bytes of Python per byte of it.
    """
    try:
        is_json = check_free_json_limits(raw, free_json)
        if not is_json and len(raw) > _OFFLOAD_BYTES:
            # orjson would build objects up to the first error: refuse a large body outright.
            raise BadRequest("request body is not valid JSON", code="invalid_json")
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
        return normalize_request(data, allow_remote_media=allow_remote_media, free_json=free_json)
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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    from .state import STATE

    state = request.app[STATE]
    started = time.perf_counter()
    rollout_id = resolve_rollout_id(request, require=state.settings.require_rollout_id)
    await state.authorize_call(request, rollout_id)
    try:
        raw = await _read_body(request, state.settings.max_body_bytes)
        s = state.settings
        remote = s.allow_remote_media
        limits = FreeJsonLimits(s.max_free_json_bytes, s.max_free_json_items)
        if len(raw) > _OFFLOAD_BYTES:
            normalized = await asyncio.to_thread(_decode_and_normalize, raw, remote, limits)
        else:
            normalized = _decode_and_normalize(raw, remote, limits)
        live = await state.capture.ensure_rollout(rollout_id)
        policy = state.capture.policy
        body = policy.apply(normalized.body, live.policy)
        staged = policy.apply(normalized.staged, live.policy)
        await _guard_context(state, body, staged)
        if len(raw) > _OFFLOAD_BYTES:
            call = await state.capture.begin_call_offloaded(
                rollout_id, staged, normalized.attachments
            )
        else:
            call = state.capture.begin_call(rollout_id, staged, normalized.attachments)
    except ProxyError as e:
        if e.status != 409:  # a sealed rollout's ledger is closed
            call_id = await state.capture.reject(rollout_id, e.code, e.message, e.status)
            e.headers.update(capture_headers(call_id, CallStatus.REJECTED))
        state.metrics.calls.labels(CallStatus.REJECTED, e.code).inc()
        raise
    try:
        info = await state.upstream.info(str(body.get("model", "")))
        plan = state.adapter(info.reasoning_field).plan(body)
        if plan.wants.stream:
            return await stream_call(state, request, call, plan, body, info, started)
        return await _unary(state, call, plan, body, info, started)
    except asyncio.CancelledError:
        # The client went away, or the shutdown deadline passed: the upstream request was
        # closed on the way out (vLLM aborts the generation); record the abort even though this
        # task is being cancelled.
        if not call.finished and not call.staging:
            if state.shutting_down:
                reason, why = "shutdown", "the proxy shut down before the answer was complete"
            else:
                reason = "client_disconnected"
                why = "the client closed the connection before the answer was complete"
            state.spawn(state.capture.fail_call(call, CallStatus.ABORTED, reason, why))
            state.metrics.calls.labels(CallStatus.ABORTED, reason).inc()
        raise
    finally:
        if not call.finished and not call.staging and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
            # Defensive: every path above completes or fails the call; never leave it pending.
            await state.capture.fail_call(call, CallStatus.UPSTREAM_ERROR, "internal", "unfinished")


async def _unary(
    state: ProxyState,
    call: Call,
    plan: ForwardPlan,
    body: dict[str, Any],
    info: Any,
    started: float,
) -> web.StreamResponse:
    t_up = time.perf_counter()
    resp = await send_upstream(state, call, plan)
    async with resp:
        if resp.status != 200:
            return await relay_upstream_error(state, call, resp)
        try:
            async with asyncio.timeout(state.settings.upstream_idle_timeout):
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            err = UpstreamFailed(
                f"the upstream answer broke off: {type(e).__name__}: {e}", code="upstream_broken"
            )
            await fail_and_raise(state, call, err)
    upstream_elapsed = time.perf_counter() - t_up
    state.metrics.upstream_seconds.observe(upstream_elapsed)
    try:
        completion, client_body = state.adapter(info.reasoning_field).parse_response(
            raw, plan, session=call.rollout_id
        )
    except UpstreamProtocolError as e:
        malformed = UpstreamFailed(f"the upstream answer is malformed: {e.message}", code=e.reason)
        await fail_and_raise(state, call, malformed)
    except CaptureExtractionError as e:
        result = StageResult.failed(e.reason, e.message)
        await state.capture.fail_call(call, CallStatus.CAPTURE_FAILED, e.reason, e.message)
        record_outcome(state, result)
        return _capture_failed_response(state, call, e.client_body or raw, result)
    result = await complete(state, call, completion, body, info)
    if result.status is not CallStatus.STAGED:
        return _capture_failed_response(state, call, client_body, result)
    state.metrics.overhead_seconds.observe(
        max(0.0, time.perf_counter() - started - upstream_elapsed)
    )
    return web.Response(
        body=client_body,
        content_type=JSON,
        headers=capture_headers(call.call_id, CallStatus.STAGED),
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
            content_type=JSON,
            headers=capture_headers(call.call_id, CallStatus.CAPTURE_FAILED),
        )
    return web.Response(
        body=client_body,
        content_type=JSON,
        headers=capture_headers(call.call_id, CallStatus.CAPTURE_FAILED),
    )
