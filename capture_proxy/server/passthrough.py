"""Routes relayed to the upstream without capture: models, tokenize, detokenize, version.

They carry ``X-Capture-Status: not_captured``. The client's headers (its Authorization above all)
are not forwarded; the proxy's own upstream key is used instead.

With ``--require-rollout-keys`` every pass-through route needs the key of the rollout the request
names, exactly as the chat route does: ``/r/{rollout_id}/...``, else ``X-Rollout-Id`` or
``x-session-id``. An un-prefixed request naming no rollout is refused (it names no key to check:
there is no key-to-rollout index, and "any valid key" would let one sandbox's key open routes for
requests that are not its own). Bodies are held to ``--max-passthrough-body-bytes``: these routes
carry small JSON, and whatever is read here is relayed upstream uncaptured.
"""

from __future__ import annotations

from aiohttp import web

from ..errors import PayloadTooLarge
from .identity import resolve_rollout_id
from .state import STATE

__all__ = ["PASSTHROUGH_PATHS", "passthrough"]

#: The routes relayed uncaptured (also under ``/r/{rollout_id}``), and the upstream path of each.
PASSTHROUGH_PATHS = ("/v1/models", "/tokenize", "/detokenize", "/version")
_UPSTREAM_PATH = {
    **{p: p for p in PASSTHROUGH_PATHS},
    **{f"/r/{{rollout_id}}{p}": p for p in PASSTHROUGH_PATHS},
}


def _too_large(limit: int, length: int | None = None) -> PayloadTooLarge:
    size = f"of {length} bytes " if length is not None else ""
    return PayloadTooLarge(
        f"request body {size}is over the pass-through limit of {limit} bytes "
        "(--max-passthrough-body-bytes)",
        code="body_too_large",
    )


async def _read_small_body(request: web.Request, limit: int) -> bytes:
    """The body, refused from its Content-Length, or while reading once past `limit`."""
    length = request.content_length
    if length is not None and length > limit:
        raise _too_large(limit, length)
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


async def passthrough(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.settings.require_rollout_keys:
        # Keyed rollouts guard every route of theirs, prefixed or not.
        await state.authorize_call(request, resolve_rollout_id(request))
    # The upstream path is the route's own, never rebuilt from the request's (decoded) path: a
    # rollout id holding %2F or %3F must not steer the proxy's key to another upstream route.
    path = _UPSTREAM_PATH[request.match_info.route.resource.canonical]  # type: ignore[union-attr]
    body = None
    if request.method == "POST":
        body = await _read_small_body(request, state.settings.max_passthrough_body_bytes)
    status, content_type, raw = await state.upstream.relay(
        request.method, path, body, request.headers.get("Content-Type")
    )
    return web.Response(
        status=status,
        body=raw,
        headers={"Content-Type": content_type, "X-Capture-Status": "not_captured"},
    )
