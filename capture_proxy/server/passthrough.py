"""Routes relayed to the upstream without capture: models, tokenize, detokenize, version.

They carry ``X-Capture-Status: not_captured``. The client's headers (its Authorization above all)
are not forwarded; the proxy's own upstream key is used instead.
"""

from __future__ import annotations

from aiohttp import web

from .state import STATE

__all__ = ["PASSTHROUGH_PATHS", "passthrough"]

#: The routes relayed uncaptured (also under ``/r/{rollout_id}``), and the upstream path of each.
PASSTHROUGH_PATHS = ("/v1/models", "/tokenize", "/detokenize", "/version")
_UPSTREAM_PATH = {
    **{p: p for p in PASSTHROUGH_PATHS},
    **{f"/r/{{rollout_id}}{p}": p for p in PASSTHROUGH_PATHS},
}


async def passthrough(request: web.Request) -> web.Response:
    state = request.app[STATE]
    rollout_id = request.match_info.get("rollout_id")
    if rollout_id is not None:
        await state.authorize_call(
            request, rollout_id
        )  # keyed rollouts guard every route of theirs
    # The upstream path is the route's own, never rebuilt from the request's (decoded) path: a
    # rollout id holding %2F or %3F must not steer the proxy's key to another upstream route.
    path = _UPSTREAM_PATH[request.match_info.route.resource.canonical]  # type: ignore[union-attr]
    body = await request.read() if request.method == "POST" else None
    status, content_type, raw = await state.upstream.relay(
        request.method, path, body, request.headers.get("Content-Type")
    )
    return web.Response(
        status=status,
        body=raw,
        headers={"Content-Type": content_type, "X-Capture-Status": "not_captured"},
    )
