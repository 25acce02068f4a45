"""The running proxy's shared state, reachable from every handler as ``request.app[STATE]``."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from ..adapters.vllm import ReasoningField, VLLMAdapter
from ..core.capture import Capture
from ..errors import Forbidden, Unauthorized
from ..sinks.base import StagingSink
from ..upstream.client import Upstream
from .metrics import Metrics
from .settings import Settings

__all__ = ["STATE", "ProxyState"]


@dataclass(eq=False)
class ProxyState:
    settings: Settings
    sink: StagingSink
    capture: Capture
    metrics: Metrics
    # Filled at startup (they need the event loop): see app.lifecycle.
    session: aiohttp.ClientSession = field(init=False)
    upstream: Upstream = field(init=False)
    upstream_url: str = ""
    #: Set when shutdown begins: calls cut off by its deadline are recorded as such.
    shutting_down: bool = False
    listen_url: str = ""
    _adapters: dict[str, VLLMAdapter] = field(default_factory=dict)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def adapter(self, reasoning_field: str) -> VLLMAdapter:
        adapter = self._adapters.get(reasoning_field)
        if adapter is None:
            rf: ReasoningField = (
                "reasoning" if reasoning_field == "reasoning" else "reasoning_content"
            )
            adapter = self._adapters[reasoning_field] = VLLMAdapter(reasoning_field=rf)
        return adapter

    def forget_rollouts(self, rollout_ids: list[str]) -> None:
        """Drop per-rollout caches of rollouts that left memory (sealed or idle)."""
        for adapter in self._adapters.values():
            for rollout_id in rollout_ids:
                adapter.prefixes.drop(rollout_id)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` to completion even if the request that started it is cancelled."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait_background(self, wait_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=wait_s)

    async def authorize_call(self, request: web.Request, rollout_id: str) -> None:
        """With --require-rollout-keys: the bearer key must be the one minted for the rollout."""
        if not self.settings.require_rollout_keys:
            return
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not auth[7:]:
            raise Unauthorized(
                "this proxy requires the rollout's key: send Authorization: Bearer <key>",
                code="missing_rollout_key",
            )
        live = await self.capture.find_rollout(rollout_id)  # never creates one
        if live is None or live.key_sha256 is None:
            raise Forbidden(
                f"rollout {rollout_id} was not created through the control API",
                code="unknown_rollout",
            )
        given = hashlib.sha256(auth[7:].encode()).hexdigest()
        if not hmac.compare_digest(given, live.key_sha256):
            raise Forbidden(
                f"the key does not belong to rollout {rollout_id}", code="wrong_rollout_key"
            )


STATE: web.AppKey[ProxyState] = web.AppKey("capture_proxy_state", ProxyState)
