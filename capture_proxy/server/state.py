"""The running proxy's shared state, reachable from every handler as ``request.app[STATE]``."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from aiohttp import web

from ..core.capture import Capture
from ..core.pipeline import Pipeline
from ..errors import Forbidden, Unauthorized
from ..sinks.base import StagingSink
from ..upstream.http import HTTPUpstream
from ..upstream.replicas import ReplicaSet
from .body_rate import BodyRate
from .connections import ConnectionGate
from .fair_share import FairShare
from .metrics import Metrics
from .settings import Settings

__all__ = ["STATE", "ProxyState", "token_bytes"]


def token_bytes(token: str) -> bytes:
    """A bearer token as bytes, whatever the client sent: aiohttp decodes header bytes that are
    not UTF-8 as surrogate escapes, which plain ``encode()`` refuses (a 500). Such a token then
    simply does not match."""
    return token.encode("utf-8", "surrogateescape")


@dataclass(eq=False)
class ProxyState:
    settings: Settings
    sink: StagingSink
    capture: Capture
    metrics: Metrics
    # Filled at startup (they need the event loop): see lifecycle.lifecycle.
    #: One upstream, or several replicas of one model (``--upstream`` given more than once).
    upstream: HTTPUpstream | ReplicaSet = field(init=False)
    #: The per-call flow every chat request runs through (`Exchange`s).
    pipeline: Pipeline = field(init=False)
    upstream_url: str = ""
    #: Set when shutdown begins: calls cut off by its deadline are recorded as such.
    shutting_down: bool = False
    listen_url: str = ""
    #: The proxy listener's connection gate (`server.run`; None in an app served otherwise).
    connections: ConnectionGate | None = None
    #: Body bytes per rollout per second (``--max-rollout-body-rate``), set by `create_app`.
    body_rate: BodyRate = field(default_factory=lambda: BodyRate(0, 0))
    #: Chat calls' turns once the proxy is busy (``--fair-share-*``), set by `create_app`.
    fair_share: FairShare = field(default_factory=lambda: FairShare(0, 0, 0.0))
    #: Set at shutdown when the store was left needing more than its file (SQLite: WAL frames
    #: an outside reader kept out of it): `serve` then exits 1.
    store_incomplete: str | None = None

    async def authorize_call(self, request: web.Request, rollout_id: str) -> None:
        """With --require-rollout-keys: the bearer key must be the one minted for the rollout.

        A connection that carried an authorized call stops counting against its address's
        connection cap (`ConnectionGate.prove`)."""
        await self._authorize(request, rollout_id)
        if self.connections is not None:
            self.connections.prove(request.transport)

    async def _authorize(self, request: web.Request, rollout_id: str) -> None:
        if not self.settings.require_rollout_keys:
            return
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth[7:]:
            raise Unauthorized(
                "this proxy requires the rollout's key: send Authorization: Bearer <key>",
                code="missing_rollout_key",
            )
        # Never creates one. A sealed rollout keeps its key hash (remembered with its id, or
        # read from the store), so its own key gets the 409 of a sealed rollout, not a 403.
        live = await self.capture.find_rollout(rollout_id)
        if live is None or live.key_sha256 is None:
            raise Forbidden(
                f"rollout {rollout_id} was not created through the control API",
                code="unknown_rollout",
            )
        given = hashlib.sha256(token_bytes(auth[7:])).hexdigest()
        if not hmac.compare_digest(given, live.key_sha256):
            raise Forbidden(
                f"the key does not belong to rollout {rollout_id}", code="wrong_rollout_key"
            )


STATE: web.AppKey[ProxyState] = web.AppKey("capture_proxy_state", ProxyState)
