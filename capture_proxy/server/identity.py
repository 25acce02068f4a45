"""Which rollout a request belongs to (docs/contract.md)."""

from __future__ import annotations

from aiohttp import web

from ..core.ids import valid_rollout_id
from ..errors import BadRequest

__all__ = ["ANONYMOUS", "resolve_rollout_id"]

ANONYMOUS = "anonymous"


def resolve_rollout_id(request: web.Request, *, require: bool = False) -> str:
    """The path's ``/r/{rollout_id}``, else ``X-Rollout-Id``, else OpenCode's ``x-session-id``.

    With none of them: ``anonymous``, or a 400 when `require` is set. An id that is not 1–128
    characters of ``[A-Za-z0-9._:-]`` is a 400 naming where it came from.
    """
    for source, value in (
        ("path /r/{rollout_id}", request.match_info.get("rollout_id")),
        ("header X-Rollout-Id", request.headers.get("X-Rollout-Id")),
        ("header x-session-id", request.headers.get("x-session-id")),
    ):
        if value is None:
            continue
        if not valid_rollout_id(value):
            raise BadRequest(
                f"rollout id from {source} must be 1-128 characters of [A-Za-z0-9._:-], "
                f"got {value[:64]!r}",
                code="invalid_rollout_id",
                param="rollout_id",
            )
        return value
    if require:
        raise BadRequest(
            "no rollout named: use the /r/{rollout_id}/v1 base URL or send X-Rollout-Id "
            "(the proxy runs with --require-rollout-id)",
            code="rollout_id_required",
            param="rollout_id",
        )
    return ANONYMOUS
