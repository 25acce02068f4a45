"""The fake vLLM's HTTP side: writing answers, injecting faults, noticing a client that left.

aiohttp does not tell a handler that its client disconnected unless the server was built with
``handler_cancellation`` (the test server is, `serve_fake`'s runner is not), so waits poll the
request's transport and stream writes treat a closed connection as an abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from ._answer import Answer, completion_body, stream_events
from ._faults import Fault, FaultKind
from ._protocol import DONE, error_body, stream_error_event
from ._validate import RequestError

__all__ = [
    "client_gone",
    "complete_raw",
    "complete_response",
    "fault_response",
    "json_response",
    "read_json",
    "wait_connected",
    "write_events",
    "write_stream",
]

_POLL = 0.01  # seconds between checks that the client is still connected
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def json_response(status: int, obj: Any) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def wait_connected(request: web.Request, seconds: float | None) -> bool:
    """Sleep ``seconds`` (None: until the client leaves); False as soon as the client is gone."""
    loop = asyncio.get_running_loop()
    deadline = None if seconds is None else loop.time() + seconds
    while not client_gone(request):
        remaining = _POLL if deadline is None else deadline - loop.time()
        if remaining <= 0:
            return True
        await asyncio.sleep(min(_POLL, remaining))
    return False


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, or the 400 vLLM gives for anything else."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    return body


def fault_response(fault: Fault) -> web.Response:
    """`Fault.http_error`: the given body, or vLLM's error shape for the status."""
    if fault.body is None:
        phrase = HTTPStatus(fault.status).phrase
        err_type = _ERROR_TYPES.get(fault.status, phrase)
        return json_response(fault.status, error_body(phrase, err_type, fault.status))
    if isinstance(fault.body, bytes | str):
        return web.Response(status=fault.status, body=fault.body, content_type="application/json")
    return json_response(fault.status, fault.body)


def complete_response(request: web.Request, answer: Answer, fault: Fault | None) -> web.Response:
    """A non-streaming answer, with the fault applied to the body."""
    return complete_raw(request, orjson.dumps(completion_body(answer)), fault)


def complete_raw(request: web.Request, raw: bytes, fault: Fault | None) -> web.Response:
    """A non-streaming JSON answer with a body fault applied: an error body, a reset, or half
    the body (malformed, truncated)."""
    kind = fault.kind if fault is not None else None
    if fault is not None and kind is FaultKind.ERROR_EVENT:
        body = error_body(fault.message, "InternalServerError", fault.status)
        return json_response(fault.status, body)
    if kind is FaultKind.RESET_AFTER:
        if request.transport is not None:
            request.transport.close()
        return web.Response()
    if kind in (FaultKind.MALFORMED_SSE, FaultKind.TRUNCATE_AFTER):
        raw = raw[: len(raw) // 2]
    return web.Response(status=200, body=raw, content_type="application/json")


async def write_stream(
    request: web.Request, answer: Answer, fault: Fault | None, chunk_delay: float
) -> tuple[web.StreamResponse, bool]:
    """Stream ``answer`` with the fault injected; return the response and whether it aborted."""
    return await write_events(
        request, stream_events(answer), fault, chunk_delay, answer_id=answer.call_id
    )


async def write_events(
    request: web.Request,
    events: Iterable[bytes],
    fault: Fault | None,
    chunk_delay: float,
    *,
    answer_id: str = "",
) -> tuple[web.StreamResponse, bool]:
    """Stream ``events`` (whole SSE events) with the fault injected at its chunk; return the
    response and whether the client went away."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    at = fault.n_chunks if fault is not None else -1
    try:
        for sent, event in enumerate(events):
            if fault is not None and sent == at:
                if fault.kind is FaultKind.RESET_AFTER:
                    if request.transport is not None:
                        request.transport.close()  # flushes what was written, then FIN
                    return resp, False
                if fault.kind is FaultKind.TRUNCATE_AFTER:
                    await resp.write_eof()
                    return resp, False
                if fault.kind is FaultKind.ERROR_EVENT:
                    # vLLM still ends the stream with [DONE] after its error event.
                    await resp.write(stream_error_event(fault.message, fault.status) + DONE)
                    await resp.write_eof()
                    return resp, False
                if fault.kind is FaultKind.MALFORMED_SSE:
                    await resp.write(
                        b'data: {"id": "' + answer_id.encode() + b'", "choices": [\n\n'
                    )
            if sent and chunk_delay > 0 and not await wait_connected(request, chunk_delay):
                return resp, True
            await resp.write(event)
    except ConnectionResetError:
        return resp, True
    await resp.write_eof()
    return resp, False
