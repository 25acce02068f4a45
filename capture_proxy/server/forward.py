"""Talking to the upstream for the chat route: sending, relaying its errors, recording outcomes.

Shared by the unary path (`chat`) and the streamed path (`chat_stream`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, NoReturn

import aiohttp
import orjson
from aiohttp import web

from ..adapters.vllm import ForwardPlan, UpstreamProtocolError, parse_error_body
from ..core.capture import Call, sampling_of
from ..errors import ProxyError, UpstreamFailed
from ..schemas.records import CallStatus, StageResult

if TYPE_CHECKING:
    from .state import ProxyState

__all__ = [
    "JSON",
    "capture_headers",
    "complete",
    "fail_and_raise",
    "fail_upstream",
    "record_outcome",
    "relay_upstream_error",
    "send_upstream",
    "sse_error",
]

JSON = "application/json"


def capture_headers(call_id: str, status: str) -> dict[str, str]:
    return {"X-Capture-Call-Id": call_id, "X-Capture-Status": status}


async def send_upstream(state: ProxyState, call: Call, plan: ForwardPlan) -> aiohttp.ClientResponse:
    """POST the call upstream; its response once the headers are in. A failure to get there is
    recorded for the call and raised as the error the client gets."""
    try:
        return await _post(state, plan)
    except UpstreamFailed as e:
        await fail_and_raise(state, call, e)


async def fail_and_raise(state: ProxyState, call: Call, err: UpstreamFailed) -> NoReturn:
    """Record `err` as the call's upstream failure, then raise it to the client."""
    await fail_upstream(state, call, err)
    err.headers.update(capture_headers(call.call_id, CallStatus.UPSTREAM_ERROR))
    raise err


async def _post(state: ProxyState, plan: ForwardPlan) -> aiohttp.ClientResponse:
    s = state.settings
    try:
        async with asyncio.timeout(s.upstream_first_byte_timeout):
            return await state.session.post(
                state.upstream.url("/v1/chat/completions"),
                data=plan.body,
                headers={**state.upstream.headers, "Content-Type": JSON},
            )
    except aiohttp.ConnectionTimeoutError:
        # Before the generic TimeoutError: aiohttp's connect timeout is a TimeoutError too.
        state.upstream.mark_stale()
        raise UpstreamFailed(
            f"could not connect to the upstream within {s.upstream_connect_timeout:g}s "
            "(--upstream-connect-timeout)",
            code="upstream_connect_timeout",
            status=504,
        ) from None
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


async def relay_upstream_error(
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
        content_type=JSON,
        headers=capture_headers(call.call_id, CallStatus.UPSTREAM_ERROR),
    )


async def fail_upstream(
    state: ProxyState, call: Call, e: ProxyError | UpstreamProtocolError
) -> None:
    reason = e.code if isinstance(e, ProxyError) else e.reason
    message = e.message
    status = e.status if isinstance(e, ProxyError) else 502
    await state.capture.fail_call(call, CallStatus.UPSTREAM_ERROR, reason, message, status)
    state.metrics.calls.labels(CallStatus.UPSTREAM_ERROR, reason).inc()


def record_outcome(state: ProxyState, result: StageResult) -> None:
    if result.status is CallStatus.STAGED and result.coords is not None:
        state.metrics.calls.labels(CallStatus.STAGED, "ok").inc()
        state.metrics.staged_records.inc()
        state.metrics.staged_tokens.inc(result.coords.cum_len)
        state.metrics.staged_token_bytes.inc(4 * result.coords.delta_len)
    else:
        state.metrics.calls.labels(CallStatus.CAPTURE_FAILED, result.reason or "").inc()


async def complete(
    state: ProxyState, call: Call, completion: Any, body: dict[str, Any], info: Any
) -> StageResult:
    """Stage the call. The staging runs as its own task: a client that goes away meanwhile
    cancels only its wait, never a write halfway, and the call still gets its outcome."""
    return await asyncio.shield(state.spawn(_complete(state, call, completion, body, info)))


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
    record_outcome(state, result)
    return result


def sse_error(message: str, code: str, type: str = "upstream_error") -> bytes:
    return (
        b"data: "
        + orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
        + b"\n\n"
    )
