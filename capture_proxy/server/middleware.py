"""The middleware every request passes: one JSON error body for every error, a deadline on
a request's body, requests counted by route and status, and one access-log line each (never
the body). Also the filter that keeps aiohttp's refusals of malformed requests to one line."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..errors import (
    CaptureUnavailable,
    NotFound,
    PayloadTooLarge,
    ProxyError,
    RequestTimeout,
    error_body,
)
from ..sinks.base import StoreError
from .chat import chat_completions
from .state import STATE, ProxyState

__all__ = ["errors_and_metrics", "quiet_parse_errors"]

log = logging.getLogger("capture_proxy")
access_log = logging.getLogger("capture_proxy.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _route_label(request: web.Request) -> str:
    info = request.match_info
    if info.http_exception is not None or info.route.resource is None:
        return "unmatched"
    return info.route.resource.canonical


def _log_access(
    state: ProxyState,
    request: web.Request,
    route: str,
    status: int,
    elapsed: float,
    headers: Mapping[str, str],
) -> None:
    """One line per request with its rollout, call id and capture outcome (never the body)."""
    call_id = headers.get("X-Capture-Call-Id")
    rollout_id = (
        request.match_info.get("rollout_id")
        or request.headers.get("X-Rollout-Id")
        or request.headers.get("x-session-id")
    )
    outcome = headers.get("X-Capture-Status")
    live = state.capture.rollouts.get(rollout_id or "anonymous") if call_id else None
    if live is not None and call_id in live.outcomes:
        outcome = str(live.outcomes[call_id].status)  # a stream's final outcome, not "pending"
    access_log.info(
        "%s %s %d",
        request.method,
        route,
        status,
        extra={
            "route": route,
            "http_status": status,
            "duration_ms": round(elapsed * 1000, 2),
            "rollout_id": rollout_id if call_id else None,
            "call_id": call_id,
            "status": outcome,
        },
    )


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One JSON error body for every error; requests counted by route and status."""
    state = request.app[STATE]
    started = time.perf_counter()
    route = _route_label(request)
    response: web.StreamResponse | None = None
    try:
        limit = state.settings.max_body_bytes
        length = request.content_length
        if (
            length is not None
            and length > limit
            and request.match_info.handler is not chat_completions
        ):
            # Every route refuses an oversized body from its header, before reading a byte (the
            # chat route does it itself, so that its ledger records the refused call).
            raise PayloadTooLarge(
                f"request body of {request.content_length} bytes is over the limit of {limit} "
                "bytes",
                code="body_too_large",
            )
        if request.body_exists and request.match_info.handler is not chat_completions:
            response = await _with_body_deadline(
                request, handler, state.settings.client_body_timeout
            )
        else:
            response = await handler(request)
        return response
    except ProxyError as e:
        response = web.Response(
            status=e.status, body=e.body(), content_type="application/json", headers=e.headers
        )
        return response
    except StoreError as e:
        # The store itself failed under a handler that reads or writes it directly (the control
        # API, the read routes): its sentence, as a 503, never a bare 500 with a traceback.
        log.error("%s %s: the store failed: %s", request.method, request.path, e)
        down = CaptureUnavailable(
            f"the store is unavailable: {e}", code="store_unavailable", headers={"Retry-After": "5"}
        )
        response = web.Response(
            status=down.status,
            body=down.body(),
            content_type="application/json",
            headers=down.headers,
        )
        return response
    except web.HTTPException as e:
        if e.status == 404:
            err: ProxyError = NotFound(
                f"{request.method} {request.path} is not a route of capture-proxy: only "
                "/v1/chat/completions is captured (plus /v1/models, /tokenize, /detokenize, "
                "/version passed through); nothing is proxied uncaptured",
                code="route_not_found",
            )
            response = web.Response(status=404, body=err.body(), content_type="application/json")
            return response
        if e.status == 405:
            response = web.Response(
                status=405,
                body=error_body(
                    f"{request.method} is not allowed on {request.path}",
                    type="invalid_request_error",
                    code="method_not_allowed",
                ),
                content_type="application/json",
                headers={"Allow": e.headers.get("Allow", "")},
            )
            return response
        response = e  # aiohttp's HTTPException is a response: log its status
        raise
    finally:
        elapsed = time.perf_counter() - started
        status = response.status if response is not None else 500
        state.metrics.requests.labels(route, str(status)).inc()
        state.metrics.request_seconds.labels(route).observe(elapsed)
        if access_log.isEnabledFor(logging.INFO):
            headers = response.headers if response is not None else {}
            _log_access(state, request, route, status, elapsed, headers)


async def _with_body_deadline(
    request: web.Request, handler: Handler, within: float
) -> web.StreamResponse:
    """Run `handler` with a deadline on the request's body: all of it must have arrived within
    `within` seconds of the head (408 otherwise), however the handler reads it. The deadline
    is lifted the moment the last byte arrives, so a slow handler is not cut short. (The chat
    route has its own, so that its ledger records the refused call.)"""
    deadline = asyncio.timeout(within)
    active = True

    def lift() -> None:
        if active and not deadline.expired():
            deadline.reschedule(None)

    try:
        async with deadline:
            request.content.on_eof(lift)
            return await handler(request)
    except TimeoutError as e:
        if not deadline.expired():
            raise
        raise RequestTimeout(
            f"the request body did not arrive within {within:g}s (--client-body-timeout)",
            code="body_timeout",
        ) from e
    finally:
        active = False


class _OneLineParseErrors(logging.Filter):
    """aiohttp logs a request it cannot parse (an over-long URL or header, a malformed request
    line) with a full traceback, once per request: a sandbox could fill the log with them. Keep
    one warning line naming the refusal (the client got aiohttp's 400) and drop the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = " ".join(str(exc.message or type(exc).__name__).split())[:160]
            record.msg = "refused a malformed request (%d): %s"
            record.args = (exc.code, reason)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_parse_errors() -> None:
    """Install `_OneLineParseErrors` on aiohttp's server log, once per process."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _OneLineParseErrors) for f in server_log.filters):
        server_log.addFilter(_OneLineParseErrors())
