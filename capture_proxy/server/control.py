"""The control API for rollout drivers (docs/contract.md): create rollouts, read manifests, seal,
send outcomes.

Every route needs ``Authorization: Bearer <admin token>`` (compared in constant time). Without
``--admin-token`` the API is off: its routes answer 404 saying so. It is served on the main port,
or on ``--admin-port`` to keep it off the network sandboxes can reach.

Request bodies are validated with pydantic models (the control API is low-volume, so msgspec's
speed buys nothing here) and refused like the chat route refuses a request: 422 with the JSON path
of the offending value in ``param`` and in the message (`capture_proxy.server.validation`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..core.ids import new_call_id, valid_rollout_id
from ..core.rollouts import RolloutLive, resume_rollout
from ..core.token_in import rollout_conflict
from ..errors import (
    Forbidden,
    NotFound,
    Unauthorized,
    Unprocessable,
    UpstreamFailed,
)
from ..schemas.events import chain_head
from ..schemas.request import RequestValidationError
from ..upstream.replicas import ENGINE_STATES, ReplicaSet
from ..upstream.weights import fleet_answer, set_weight_version
from .outcomes import put_outcome as store_outcome
from .read_routes import reader_may_not
from .state import STATE, ProxyState, token_bytes
from .validation import answer_for, check_rollout_policy, read_body

__all__ = ["add_control_routes"]

log = logging.getLogger(__name__)


class CreateRollout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollout_id: str | None = Field(default=None, min_length=1, max_length=128)
    policy: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    #: The rollout's token-in choice; None: the proxy's ``--token-in`` setting. Strict: "yes"
    #: or 1 is refused, not read as true.
    token_in: bool | None = Field(default=None, strict=True)


class WeightVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: int = Field(ge=0)


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: int | None = Field(default=None, ge=0)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _authorize(request: web.Request) -> ProxyState:
    state = request.app[STATE]
    token = state.settings.admin_token
    if not token:
        raise NotFound(
            "the control API is off: start capture-proxy with --admin-token", code="control_api_off"
        )
    auth = request.headers.get("Authorization", "")
    given = auth[7:] if auth.startswith("Bearer ") else ""
    if not hmac.compare_digest(token_bytes(given), token.encode()):
        if reader_may_not(request):
            raise Forbidden(
                "the reader token only reads the store (/admin/store); this route needs the "
                "admin token",
                code="reader_token_read_only",
            )
        raise Unauthorized(
            "the control API needs Authorization: Bearer <admin token>", code="admin_token"
        )
    return state


def _base_url(state: ProxyState, request: web.Request, rollout_id: str) -> str:
    base = state.settings.public_url or state.listen_url or f"{request.scheme}://{request.host}"
    return f"{base.rstrip('/')}/r/{rollout_id}/v1"


async def create_rollout(request: web.Request) -> web.Response:
    state = _authorize(request)
    body = read_body(await request.read(), CreateRollout)
    rollout_id = body.rollout_id or f"ro-{new_call_id().lower()}"
    if not valid_rollout_id(rollout_id):
        raise Unprocessable(
            f"Invalid value {rollout_id[:64]!r} at rollout_id; a rollout id is 1-128 characters "
            "of [A-Za-z0-9._:-]",
            code="invalid_rollout_id",
            param="rollout_id",
        )
    try:
        check_rollout_policy(body.policy)
    except RequestValidationError as e:
        raise answer_for(e) from e
    if body.token_in and state.upstream.known.scale_out is False:
        raise rollout_conflict()
    key = secrets.token_urlsafe(32) if state.settings.require_rollout_keys else None
    await state.capture.create_rollout(
        rollout_id, key=key, policy=body.policy, metadata=body.metadata, token_in=body.token_in
    )
    return _json(
        {
            "rollout_id": rollout_id,
            "base_url": _base_url(state, request, rollout_id),
            "api_key": key,
            "token_in": body.token_in,
        },
        status=201,
    )


def _manifest_live(live: RolloutLive, state: ProxyState) -> dict[str, Any]:
    outcomes = sorted(live.outcomes.values(), key=lambda o: o.seq)
    cap = state.capture
    return {
        "rollout_id": live.rollout_id,
        "state": "sealed" if live.sealed else "open",
        "poisoned": live.poisoned,
        "in_flight": live.in_flight,
        # The rollout's token-in choice (None: the proxy's --token-in), and what its calls do.
        "token_in": live.token_in,
        "goes_token_in": state.pipeline.goes_token_in(live),
        # The rollout's quotas: what it used (refused calls not counted; bytes as
        # `record_bytes`, plus the bodies of calls in flight) and the limits (None: none).
        "usage": {
            "calls": live.calls_used,
            "bytes": live.bytes_staged,
            "bytes_in_flight": live.bytes_reserved,
        },
        "limits": {
            "calls": cap.max_rollout_calls or None,
            "bytes": cap.max_rollout_bytes or None,
        },
        "calls": [o.to_dict() for o in outcomes],
        # The driver's latest outcome (PUT .../outcome), None before any.
        "outcome": live.outcome_history[-1].to_dict() if live.outcome_history else None,
    }


def _manifest_from_store(state: ProxyState, rollout_id: str) -> dict[str, Any] | None:
    """A manifest rebuilt from the store, for rollouts this process does not hold (a restart,
    or sealed and released from memory). Blocking I/O: run it on a thread."""
    source = state.capture.source
    if source is None:
        return None
    live = resume_rollout(source, rollout_id)
    return None if live is None else _manifest_live(live, state)


async def manifest(request: web.Request) -> web.Response:
    state = _authorize(request)
    rollout_id = request.match_info["rollout_id"]
    live = state.capture.rollouts.get(rollout_id)
    if live is not None:
        return _json(_manifest_live(live, state))
    found = await asyncio.to_thread(_manifest_from_store, state, rollout_id)
    if found is None:
        raise NotFound(f"no rollout {rollout_id}", code="unknown_rollout")
    return _json(found)


def _chain_head(state: ProxyState, rollout_id: str) -> str | None:
    """The rollout's chain head as the store holds it now (`schemas.events.chain_head`), or
    None without a store to read. Blocking I/O: run it on a thread."""
    source = state.capture.source
    return None if source is None else chain_head(source().events(rollout_id))


async def seal(request: web.Request) -> web.Response:
    """The final manifest, with the rollout's ``chain_head`` once sealed: the anchor a driver
    keeps to refuse a rewritten rollout later (docs/contract.md, "Anchored reads")."""
    state = _authorize(request)
    rollout_id = request.match_info["rollout_id"]
    try:
        live = await state.capture.seal(rollout_id, state.settings.seal_timeout)
        state.pipeline.forget_rollouts([rollout_id])
    except KeyError as exc:
        raise NotFound(f"no live rollout {rollout_id} to seal", code="unknown_rollout") from exc
    answer = _manifest_live(live, state)
    answer["chain_head"] = await asyncio.to_thread(_chain_head, state, rollout_id)
    return _json(answer)


async def put_weight_version(request: web.Request) -> web.Response:
    state = _authorize(request)
    body = read_body(await request.read(), WeightVersion)
    return _json(await set_weight_version(state.capture, state.upstream, body.weight_version))


async def pause_weights(request: web.Request) -> web.Response:
    """Stop admitting calls, wait for those in flight (cut at the deadline), pause the engine.

    Idempotent: a second pause waits for nothing new and pauses the engine again (a no-op
    there). An engine that fails to pause is a 502; the proxy stays paused, so a retry is safe.
    """
    state = _authorize(request)
    capture = state.capture
    already = capture.pause()
    # The version the store holds now (another proxy on it may have set one): stamped on the
    # calls admitted after the resume, unless the resume sets another.
    await capture.refresh_weight_version()
    still = await capture.wait_idle(state.settings.pause_drain_timeout)
    cut = capture.cut(still, "weights_paused")
    upstream = state.upstream
    if isinstance(upstream, ReplicaSet):
        results = await upstream.on_healthy(lambda u: u.pause_engine(), "paused", ENGINE_STATES)
        engine_answer = fleet_answer("engine", results, "paused")
        if engine_answer["engine"] == "failed":
            raise UpstreamFailed(
                f"pausing the replicas failed: {engine_answer['engine_error']}",
                code="upstream_weights_route",
            )
    else:
        engine = await upstream.pause_engine()
        engine_answer = {"engine": "paused" if engine else "not_served"}
    return _json(
        {
            "paused": True,
            "already_paused": already,
            "cut": [{"call_id": c.call_id, "rollout_id": c.rollout_id, "seq": c.seq} for c in cut],
            **engine_answer,
        }
    )


async def resume_weights(request: web.Request) -> web.Response:
    """Set the weight version if given (as `PUT /admin/weight-version`), resume the engine, then
    admit calls again. Idempotent. An engine that fails to resume is a 502 and the proxy stays
    paused: its calls would not be answered anyway."""
    state = _authorize(request)
    raw = await request.read()
    body = read_body(raw, ResumeBody) if raw.strip() else ResumeBody()
    # Without a version: the one the store holds now (another proxy on it may have set it).
    answer: dict[str, Any] = {"weight_version": await state.capture.refresh_weight_version()}
    if body.weight_version is not None:
        answer = await set_weight_version(state.capture, state.upstream, body.weight_version)
    upstream = state.upstream
    if isinstance(upstream, ReplicaSet):
        results = await upstream.on_healthy(lambda u: u.resume_engine(), "resumed", ENGINE_STATES)
        resume = fleet_answer("engine_resume", results, "resumed")
        if resume["engine_resume"] == "failed":
            raise UpstreamFailed(
                f"resuming the replicas failed: {resume['engine_resume_error']}",
                code="upstream_weights_route",
            )
    else:
        resume = {"engine_resume": "resumed" if await upstream.resume_engine() else "not_served"}
    state.capture.resume()
    return _json({"paused": False, **answer, **resume})


async def put_outcome(request: web.Request) -> web.Response:
    state = _authorize(request)
    rollout_id = request.match_info["rollout_id"]
    answer = await store_outcome(state.capture, rollout_id, await request.read())
    # The outcome's event moved the chain's head: the driver keeps this one now.
    answer["chain_head"] = await asyncio.to_thread(_chain_head, state, rollout_id)
    return _json(answer)


def add_control_routes(app: web.Application) -> None:
    app.router.add_post("/admin/rollouts", create_rollout)
    app.router.add_get("/admin/rollouts/{rollout_id}/manifest", manifest)
    app.router.add_post("/admin/rollouts/{rollout_id}/seal", seal)
    app.router.add_put("/admin/rollouts/{rollout_id}/outcome", put_outcome)
    app.router.add_put("/admin/weight-version", put_weight_version)
    app.router.add_post("/admin/weights/pause", pause_weights)
    app.router.add_post("/admin/weights/resume", resume_weights)
