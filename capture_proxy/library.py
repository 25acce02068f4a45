"""Capture without the HTTP hop, for frameworks that drive vLLM from their own process.

`CaptureClient` runs the proxy's own per-call flow (`capture_proxy.core.exchange.Exchange`):
normalization, strict validation, the request policy, the context guard, the token fields vLLM
must return, the upstream round trip, record building, digests, staging and the ledger::

    client = CaptureClient(open_sink("sqlite:///capture.db"), upstream="http://127.0.0.1:8000")
    result = await client.chat("rollout-7", request)    # ChatResult
    result.status      # "staged", "capture_failed", "upstream_error" (ledgered), ...
    result.body        # what a client of the proxy would get (JSON, or the SSE bytes)
    await client.close()

A framework that must send the request itself uses the thin wrapper around the same flow::

    call = await client.begin_call("rollout-7", request)  # RequestValidationError if refused
    raw = ...                                   # POST call.body to vLLM's /v1/chat/completions
    result = await client.complete_call(call, raw)       # StageResult; call.client_body

The driver's side of the control API is here too, through the code its routes run::

    await client.set_weight_version(8)      # stored, stamped on later calls, pushed to vLLM
    await client.put_outcome("rollout-7", {"reward": 1.0, "group_id": "g3"})

The records are the ones the proxy stages for the same exchange.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .adapters.vllm import ForwardPlan, VLLMAdapter
from .core.call import Call
from .core.capture import Capture
from .core.exchange import Exchange
from .core.pipeline import ExchangeConfig, Outcome, Pipeline
from .core.policy import RequestPolicy
from .core.shared_reader import SharedReader
from .core.transport import UpstreamInfo, UpstreamReply, UpstreamTransport
from .errors import ProxyError, UpstreamFailed
from .schemas.records import CallStatus, StageResult
from .schemas.request import FreeJsonLimits, RequestValidationError
from .sinks.base import StagingSink, StagingSource

__all__ = ["CaptureClient", "ChatResult", "PreparedCall"]


@dataclass(slots=True)
class ChatResult:
    """How one `CaptureClient.chat` call ended."""

    #: ``staged``, ``capture_failed`` or ``upstream_error``.
    status: CallStatus
    call_id: str
    #: The HTTP status a client of the proxy would see for the answer (200, or the upstream's).
    http_status: int
    #: The answer as a client of the proxy would see it: JSON, or the whole SSE byte stream.
    body: bytes
    #: The staging result (coordinates when staged), None when nothing was staged.
    result: StageResult | None
    reason: str = ""
    message: str = ""


@dataclass(slots=True)
class PreparedCall:
    """An admitted call: send `body` to the upstream's /v1/chat/completions."""

    exchange: Exchange
    #: The answer a client should see (token fields it did not ask for removed), once complete.
    client_body: bytes | None = None

    @property
    def call(self) -> Call:
        return self.exchange.admitted

    @property
    def plan(self) -> ForwardPlan:
        assert self.exchange.plan is not None
        return self.exchange.plan

    @property
    def request(self) -> dict[str, Any]:
        """The effective request as forwarded (policy applied, images inline), decoded."""
        return self.exchange.request

    @property
    def body(self) -> bytes:
        return self.plan.body

    @property
    def call_id(self) -> str:
        return self.call.call_id


class CaptureClient:
    """The proxy's capture flow as a library.

    `upstream` is the vLLM to call (a base URL, or any `UpstreamTransport`); without one, only
    `begin_call`/`complete_call` work (the caller sends the request). The timeouts are the
    proxy's ``--upstream-*-timeout`` settings for a URL upstream. `max_model_len` turns on
    the context guard (refuse, or with ``context_overflow="cap"`` cap max_tokens); `free_json`
    bounds free-form JSON values as the proxy's ``--max-free-json-*`` settings do. `token_in`
    sends `chat` and `stream` calls token-in as ``--token-in on`` does (docs/token-in.md; the
    upstream must serve vLLM's scale-out routes). Rollouts seen
    before (by this process or an earlier one) resume from the store through a reader on the
    sink's own store; `source` replaces that reader.
    """

    def __init__(
        self,
        sink: StagingSink,
        *,
        upstream: str | UpstreamTransport | None = None,
        api_key: str = "",
        connect_timeout: float = 10.0,
        first_byte_timeout: float = 600.0,
        idle_timeout: float = 300.0,
        adapter: VLLMAdapter | None = None,
        policy: RequestPolicy | None = None,
        stage_timeout: float = 10.0,
        max_pending: int = 256,
        allow_remote_media: bool = False,
        max_model_len: int = 0,
        context_overflow: str = "refuse",
        free_json: FreeJsonLimits | None = None,
        source: Callable[[], StagingSource] | None = None,
        token_in: bool = False,
    ) -> None:
        self._reader = SharedReader(sink) if source is None else None
        self.capture = Capture(
            sink,
            stage_timeout=stage_timeout,
            max_pending=max_pending,
            policy=policy,
            source=source if source is not None else self._reader,
        )
        self._own_upstream: Any = None
        if isinstance(upstream, str):
            from .upstream.http import HTTPUpstream  # aiohttp only when it is used

            upstream = self._own_upstream = HTTPUpstream(
                upstream,
                api_key=api_key,
                connect_timeout=connect_timeout,
                first_byte_timeout=first_byte_timeout,
                idle_timeout=idle_timeout,
            )
        self.pipeline = Pipeline(
            self.capture,
            upstream if upstream is not None else _NoUpstream(),
            ExchangeConfig(
                allow_remote_media=allow_remote_media,
                max_model_len=max_model_len,
                context_overflow="cap" if context_overflow == "cap" else "refuse",
                free_json=free_json or FreeJsonLimits(),
                token_in="on" if token_in else "off",
            ),
        )
        if adapter is not None:
            self.pipeline.use_adapter(adapter)
        # The weight version last set on the store, taken up before the first call or set (as
        # a proxy does at start): one task that every first caller awaits.
        self._restoring: asyncio.Future[int] | None = None
        self._restored = False

    async def _ready(self) -> None:
        if self._restored:
            return
        if self._restoring is None:
            self._restoring = asyncio.ensure_future(self.capture.restore_weight_version())
        await self._restoring
        self._restored = True

    @property
    def weight_version(self) -> int:
        """The weight version stamped on calls admitted now: the one last set on the store
        (taken up at the first call or `set_weight_version`; 0 before, and on a store where
        none was set). Read-only: set it with `set_weight_version`."""
        return self.capture.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.capture.weight_version = version  # raises AttributeError naming the setter

    async def set_weight_version(self, version: int) -> dict[str, Any]:
        """Stamp later calls with `version`, as ``PUT /admin/weight-version`` does (the same code).

        The version is stored first (a client or proxy opened on the store later stamps it
        too), then pushed to the upstream's ``/update_weight_version`` when it serves it.
        Returns the route's answer: ``{"weight_version", "engine": "updated" | "not_served" |
        "failed", "engine_error"?}`` (``not_served`` without an upstream URL). A version lower
        than the previous one is taken (a rollback): each rollout's next call is flagged
        ``weight_version_decreased_from``. Raises `ProxyError`: 422 (``param``
        ``weight_version``) for anything but an integer of 0 or more, 503
        ``weight_version_not_stored`` when the store cannot take it (calls keep the previous
        version).
        """
        from .upstream.weights import set_weight_version  # aiohttp only when it is used

        await self._ready()
        return await set_weight_version(self.capture, self.pipeline.upstream, version)

    async def chat(self, rollout_id: str, request: bytes | Mapping[str, Any]) -> ChatResult:
        """Run one call through the whole flow: validate, admit, call the upstream, stage.

        Raises `ProxyError` for a refused request (recorded as ``rejected``; its
        `RequestValidationError` is the ``__cause__``) and `UpstreamFailed` when the upstream
        cannot be reached or its answer breaks off (recorded as ``upstream_error``).
        """
        await self._ready()
        exchange = self.pipeline.exchange(rollout_id)
        await exchange.prepare(request)
        try:
            outcome = await exchange.send()
            if outcome is None and exchange.streamed:
                body = b"".join([piece async for piece in exchange.relay_stream()])
                outcome = exchange.outcome
                assert outcome is not None
                outcome.body = body
            elif outcome is None:
                outcome = await exchange.read_unary()
        finally:
            if not exchange.finished:
                await exchange.abort("client_disconnected", "the caller stopped waiting")
        return _result(outcome)

    async def stream(self, rollout_id: str, request: bytes | Mapping[str, Any]) -> Streamed:
        """Like `chat` for a streamed request, yielding the SSE bytes as they arrive."""
        await self._ready()
        exchange = self.pipeline.exchange(rollout_id)
        await exchange.prepare(request)
        return Streamed(exchange)

    async def begin_call(self, rollout_id: str, request: Mapping[str, Any]) -> PreparedCall:
        """Normalize, validate and admit a request. Raises `RequestValidationError` for a bad
        one (recorded in the rollout's ledger as ``rejected``) and `ProxyError` for admission
        refusals (sealed rollout, limits)."""
        await self._ready()
        exchange = self.pipeline.exchange(rollout_id)
        try:
            await exchange.prepare(request)
        except ProxyError as e:
            if isinstance(e.__cause__, RequestValidationError):
                raise e.__cause__ from None
            raise
        return PreparedCall(exchange)

    async def complete_call(
        self,
        prepared: PreparedCall,
        response: bytes | Mapping[str, Any],
        *,
        upstream: UpstreamInfo | None = None,
    ) -> StageResult:
        """Stage the call from the upstream's 200 answer: the JSON body, or for a streamed
        call the whole SSE byte stream. Never raises for capture problems."""
        exchange = prepared.exchange
        if upstream is not None:
            exchange.info = upstream
        raw = response if isinstance(response, bytes) else orjson.dumps(response)
        try:
            if exchange.streamed:
                outcome = await exchange.finish_stream(raw)
            else:
                outcome = await exchange.finish_unary(raw)
        except UpstreamFailed as e:
            return StageResult(CallStatus.UPSTREAM_ERROR, None, e.code, e.message)
        prepared.client_body = outcome.body or prepared.client_body
        if outcome.result is not None:
            return outcome.result
        return StageResult(outcome.status, None, outcome.reason, outcome.message)

    async def fail_call(
        self,
        prepared: PreparedCall,
        reason: str,
        message: str,
        *,
        status: CallStatus = CallStatus.UPSTREAM_ERROR,
        http_status: int | None = None,
    ) -> None:
        """Record a call that ended without an answer to stage (upstream error, abort)."""
        await self.capture.fail_call(prepared.call, status, reason, message[:500], http_status)

    async def put_outcome(
        self, rollout_id: str, outcome: bytes | Mapping[str, Any]
    ) -> dict[str, Any]:
        """Store the rollout's outcome as ``PUT /admin/rollouts/{id}/outcome`` does (the same code).

        `outcome` is the route's body, a dict or its JSON bytes: ``reward`` (a number, or an
        object of numbers), ``group_id`` and ``metadata``, one of them at least; a later outcome
        replaces the whole earlier one as the rollout's latest, the history keeping each. Open or
        sealed rollouts alike, known to this client or only to the store. Returns the route's
        answer, ``{"rollout_id", "state", "outcome", "revisions"}``. Raises the route's errors
        as `ProxyError`: 404 ``unknown_rollout``, 422 naming the value refused (``param``, e.g.
        ``reward.pass``; a NaN included), 422 ``empty_outcome``, 413 ``outcome_too_large``, 409
        past the outcomes kept per rollout, 503 ``outcome_not_stored`` (nothing changed); and
        `TypeError` for a dict holding a value JSON cannot.
        """
        from .server.outcomes import put_outcome  # pydantic only when it is used

        # The standard library writes NaN and infinities as such, so the route's decoding
        # refuses them by name (orjson would write null, silently dropping the reward).
        raw = outcome if isinstance(outcome, bytes) else json.dumps(outcome).encode()
        return await put_outcome(self.capture, rollout_id, raw)

    async def seal(self, rollout_id: str, wait_s: float = 60.0) -> None:
        await self.capture.seal(rollout_id, wait_s)
        self.pipeline.forget_rollouts([rollout_id])

    async def close(self) -> None:
        await self.pipeline.wait_background(self.capture.stager.timeout)
        await self.capture.drain(self.capture.stager.timeout)
        await self.capture.ledger.flush()
        await self.capture.sink.close()
        if self._reader is not None:
            self._reader.close()
        if self._own_upstream is not None:
            await self._own_upstream.close()


class Streamed:
    """A streamed call in progress: iterate it for the SSE bytes; `result` once it is over."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.result: ChatResult | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        exchange = self.exchange
        try:
            outcome = await exchange.send()
            if outcome is None:
                async for piece in exchange.relay_stream():
                    yield piece
                outcome = exchange.outcome
            assert outcome is not None
            self.result = _result(outcome)
        finally:
            if not exchange.finished:
                await exchange.abort("client_disconnected", "the caller stopped reading")


def _result(outcome: Outcome) -> ChatResult:
    return ChatResult(
        outcome.status,
        outcome.call_id,
        outcome.http_status,
        outcome.body,
        outcome.result,
        outcome.reason,
        outcome.message,
    )


class _NoUpstream:
    """The upstream of a client whose caller sends requests itself: facts unknown."""

    async def info(self, model: str) -> UpstreamInfo:
        return UpstreamInfo("", "reasoning_content", "")

    async def count_prompt_tokens(self, request: Mapping[str, Any]) -> int:
        raise UpstreamFailed(
            "the context guard needs an upstream: CaptureClient(..., upstream=URL)",
            code="context_guard",
        )

    async def post_chat(self, body: bytes) -> UpstreamReply:
        raise UpstreamFailed(
            "this CaptureClient has no upstream: pass CaptureClient(..., upstream=URL) to chat",
            code="no_upstream",
        )
