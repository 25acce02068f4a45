"""Routes relayed to the upstream without capture: models, tokenize, detokenize, version.

They carry ``X-Capture-Status: not_captured``. The client's headers (its Authorization above all)
are not forwarded; the proxy's own upstream key is used instead.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from ..errors import UpstreamFailed
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
    headers = dict(state.upstream.headers)
    if body is not None:
        headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
    try:
        async with state.session.request(
            request.method,
            state.upstream.url(path),
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=state.settings.upstream_first_byte_timeout),
        ) as resp:
            raw = await resp.read()
            content_type = resp.headers.get("Content-Type", "application/json")
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as e:
        state.upstream.mark_stale()
        raise UpstreamFailed(f"cannot reach the upstream: {type(e).__name__}: {e}") from None
    return web.Response(
        status=status,
        body=raw,
        headers={"Content-Type": content_type, "X-Capture-Status": "not_captured"},
    )
