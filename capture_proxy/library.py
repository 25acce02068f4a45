"""Capture without the HTTP hop, for frameworks that call vLLM themselves.

`CaptureClient` runs exactly what the proxy runs for a call — normalization, strict validation,
the request policy, the token fields vLLM must return, record building, digests, staging, the
ledger — around a request *you* send::

    client = CaptureClient(open_sink("sqlite:///capture.db"))
    call = await client.begin_call("rollout-7", request)        # raises RequestValidationError
    async with session.post(f"{vllm}/v1/chat/completions", data=call.body,
                            headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()                                 # or the whole SSE stream
    if resp.status != 200:
        await client.fail_call(call, f"upstream_{resp.status}", raw.decode(),
                               http_status=resp.status)
    else:
        result = await client.complete_call(call, raw, upstream=info)   # StageResult
        answer = call.client_body                                # what a client should see

`result.status` is ``staged`` (with `result.coords`) or ``capture_failed`` (in the ledger, the
rollout poisoned). The records are the ones the proxy would stage for the same exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .adapters.vllm import (
    CaptureExtractionError,
    ForwardPlan,
    UpstreamProtocolError,
    VLLMAdapter,
)
from .core.capture import Call, Capture, sampling_of
from .core.normalize import normalize_request
from .core.policy import RequestPolicy
from .schemas.records import CallStatus, StageResult
from .sinks.base import StagingSink, StagingSource
from .upstream.client import UpstreamInfo

__all__ = ["CaptureClient", "PreparedCall"]


@dataclass(slots=True)
class PreparedCall:
    """An admitted call: send `body` to the upstream's /v1/chat/completions."""

    call: Call
    plan: ForwardPlan
    #: The effective request as forwarded (policy applied, images inline), decoded.
    request: dict[str, Any]
    #: The answer a client should see (token fields it did not ask for removed), once complete.
    client_body: bytes | None = None

    @property
    def body(self) -> bytes:
        return self.plan.body

    @property
    def call_id(self) -> str:
        return self.call.call_id


class CaptureClient:
    """The capture core with its vLLM adapter, as a library."""

    def __init__(
        self,
        sink: StagingSink,
        *,
        adapter: VLLMAdapter | None = None,
        policy: RequestPolicy | None = None,
        stage_timeout: float = 10.0,
        max_pending: int = 256,
        allow_remote_media: bool = False,
        source: Callable[[], StagingSource] | None = None,
    ) -> None:
        self.capture = Capture(
            sink,
            stage_timeout=stage_timeout,
            max_pending=max_pending,
            policy=policy,
            source=source,
        )
        self.adapter = adapter or VLLMAdapter()
        self.allow_remote_media = allow_remote_media

    async def begin_call(self, rollout_id: str, request: Mapping[str, Any]) -> PreparedCall:
        """Normalize, validate and admit a request; raises `RequestValidationError` for a bad
        one (recorded in the rollout's ledger as ``rejected``) and `ProxyError` for admission
        refusals (sealed rollout, limits)."""
        from .schemas.request import RequestValidationError

        live = await self.capture.ensure_rollout(rollout_id)
        try:
            normalized = normalize_request(request, allow_remote_media=self.allow_remote_media)
        except RequestValidationError as e:
            await self.capture.reject(rollout_id, e.code, e.message, e.status)
            raise
        policy = self.capture.policy
        body = policy.apply(normalized.body, live.policy)
        staged = policy.apply(normalized.staged, live.policy)
        call = self.capture.begin_call(rollout_id, staged, normalized.attachments)
        return PreparedCall(call, self.adapter.plan(body), body)

    async def complete_call(
        self,
        prepared: PreparedCall,
        response: bytes | Mapping[str, Any],
        *,
        upstream: UpstreamInfo | None = None,
    ) -> StageResult:
        """Stage the call from the upstream's 200 answer: the JSON body, or for a streamed
        call the whole SSE byte stream. Never raises for capture problems."""
        call, plan = prepared.call, prepared.plan
        raw = response if isinstance(response, bytes) else orjson.dumps(response)
        try:
            if plan.wants.stream:
                acc = self.adapter.stream(plan, session=call.rollout_id)
                prepared.client_body = b"".join(acc.feed(raw))
                completion = acc.finish()
            else:
                completion, prepared.client_body = self.adapter.parse_response(
                    raw, plan, session=call.rollout_id
                )
        except UpstreamProtocolError as e:
            await self.capture.fail_call(call, CallStatus.UPSTREAM_ERROR, e.reason, e.message, 502)
            return StageResult(CallStatus.UPSTREAM_ERROR, None, e.reason, e.message)
        except CaptureExtractionError as e:
            prepared.client_body = e.client_body or prepared.client_body
            await self.capture.fail_call(call, CallStatus.CAPTURE_FAILED, e.reason, e.message)
            return StageResult.failed(e.reason, e.message)
        return await self.capture.complete_call(
            call,
            completion,
            model=str(prepared.request.get("model", "")),
            upstream_version=upstream.version if upstream else "",
            tokenizer_fingerprint=upstream.fingerprint if upstream else "",
            sampling=sampling_of(prepared.request),
        )

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

    async def seal(self, rollout_id: str, wait_s: float = 60.0) -> None:
        await self.capture.seal(rollout_id, wait_s)

    async def close(self) -> None:
        await self.capture.drain(self.capture.stager.timeout)
        await self.capture.ledger.flush()
        await self.capture.sink.close()
