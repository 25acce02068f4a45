"""One call, from the client's body to its outcome: the flow the proxy and the library share.

    exchange = pipeline.exchange(rollout_id)
    await exchange.prepare(body)          # decode, normalize, validate, policy, admit, plan
    failed = await exchange.send()        # POST upstream; an upstream error is already recorded
    outcome = await exchange.read_unary() # or: async for piece in exchange.relay_stream(): ...

Every step that ends the call records why: a refused body is ``rejected`` in the ledger, an
upstream failure ``upstream_error``, a client that went away ``aborted`` (`abort`), an answer
that cannot be staged ``capture_failed``. Staging runs as its own task (`Pipeline.spawn`), so a
client that leaves mid-write cancels only its wait, never the write. The HTTP handler
(`capture_proxy.server.chat`) only turns bodies and `Outcome`s into HTTP; `CaptureClient`
(`capture_proxy.library`) runs the same flow in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import replace
from typing import Any

import orjson

from ..adapters.vllm import (
    CaptureExtractionError,
    Completion,
    ForwardPlan,
    UpstreamProtocolError,
    VLLMAdapter,
    WeightSpan,
    parse_error_body,
)
from ..errors import BadRequest, PayloadTooLarge, ProxyError, Unprocessable, UpstreamFailed
from ..schemas.records import CallStatus, StageResult
from ..schemas.request import (
    RequestValidationError,
    check_body_items,
    check_free_json_limits,
)
from .call import Call, sampling_of
from .normalize import NormalizedRequest, normalize_request
from .pipeline import ExchangeConfig, Outcome, Pipeline
from .sampling import effective_sampling
from .token_in import (
    RenderRefused,
    TokenInCall,
    check_scale_out,
)
from .transport import (
    EngineWeights,
    UpstreamInfo,
    UpstreamReply,
    UpstreamRestarted,
)

__all__ = ["Exchange", "decode_and_normalize"]

log = logging.getLogger("capture_proxy.exchange")

#: Bodies above this are decoded and normalized, and their request key and digest computed, on
#: a worker thread: base64-decoding a large image or walking large JSON would otherwise stall
#: every other call on the event loop.
OFFLOAD_BYTES = 1 << 20


def decode_and_normalize(
    raw: bytes | Mapping[str, Any], config: ExchangeConfig, *, items_counted: bool = False
) -> NormalizedRequest:
    """The one JSON decode of a body, then normalization and strict validation, as the
    `ProxyError` a client gets (`RequestValidationError` stays its cause).

    The whole body's values, then its free-form values, are bounded on the raw body first: a
    hostile body is refused before the decode builds ~30 bytes of Python per byte of it.
    `items_counted`: the caller counted the body's values against ``max_json_items`` as it
    arrived (`capture_proxy.schemas.request.count_body_items`), so they are not counted again.
    """
    free_json = config.free_json
    try:
        if isinstance(raw, bytes | bytearray):
            body = bytes(raw)
            if not items_counted:
                check_body_items(body, config.max_json_items)
            is_json = check_free_json_limits(body, free_json)
            if not is_json and len(raw) > OFFLOAD_BYTES:
                # orjson would build objects up to the first error: refuse a large body outright.
                raise BadRequest("request body is not valid JSON", code="invalid_json")
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from e
        else:
            data = raw
        remote = config.allow_remote_media
        return normalize_request(data, allow_remote_media=remote, free_json=free_json)
    except RequestValidationError as e:
        err = PayloadTooLarge if e.status == 413 else Unprocessable
        raise err(e.message, code=e.code, param=e.param) from e


class Exchange:
    """One client call through a `Pipeline`; see the module docstring for the order of steps.

    A token-in call (`token_in`) takes the same steps, the token-in parts of them through its
    `TokenInCall` (`capture_proxy.core.token_in`)."""

    def __init__(self, pipeline: Pipeline, rollout_id: str) -> None:
        self.pipeline = pipeline
        self.capture = pipeline.capture
        self.rollout_id = rollout_id
        self.started = time.perf_counter()
        #: Set by `prepare` once the call is admitted.
        self.call: Call | None = None
        self.request: dict[str, Any] = {}
        self.plan: ForwardPlan | None = None
        self.info = UpstreamInfo("", "reasoning_content", "")
        self.outcome: Outcome | None = None
        #: The upstream this call goes to, and its replica's name ("" for a single upstream).
        self.upstream = pipeline.upstream
        self.replica = ""
        #: The engine's weight version read for this call before it is sent (None: unknown).
        self.engine_before: str | None = None
        self._reply: UpstreamReply | None = None
        self._t_up = 0.0
        self._upstream_s: float | None = None
        #: Whether the call goes token-in (known once prepared), and then its token-in steps
        #: (docs/token-in.md).
        self.token_in = False
        self._token_in: TokenInCall | None = None

    # -- prepare -----------------------------------------------------------------------------

    async def prepare(
        self, body: bytes | Mapping[str, Any], *, items_counted: bool = False
    ) -> None:
        """Decode, normalize, validate, apply the policy, admit and plan the call.

        Raises the `ProxyError` the client gets; a refusal is in the rollout's ledger as
        ``rejected`` (except 409: a sealed rollout's ledger is closed). `items_counted`: see
        `decode_and_normalize`.
        """
        capture = self.capture
        try:
            config = self.pipeline.config
            size = len(body) if isinstance(body, bytes) else 0  # held against the byte quota
            large = size > OFFLOAD_BYTES
            if large:
                # Worker threads decode large bodies side by side: they take turns by size.
                async with self.pipeline.decode_budget.hold(size):
                    normalized = await asyncio.to_thread(
                        decode_and_normalize, body, config, items_counted=items_counted
                    )
            else:
                normalized = decode_and_normalize(body, config, items_counted=items_counted)
            # Decoded: the raw bytes go (a caller that hands them over keeps no reference:
            # ``server.chat``), so a large body is not held twice while the call is planned,
            # forwarded and answered.
            del body
            await capture.hold_while_paused()
            live = await capture.ensure_rollout(self.rollout_id)
            replicas = self.pipeline.replicas
            if replicas is not None:
                # Set first: a refusal for a pinned rollout (its replica unhealthy) names it.
                self.replica = live.replica
                self.replica, self.upstream = self.pipeline.route(live)
            request = capture.policy.apply(normalized.body, live.policy)
            token_in = self.pipeline.goes_token_in(live)
            if token_in:
                # Refused before admission while the upstream lacks the routes token-in needs.
                await check_scale_out(self.upstream, str(request.get("model", "")))
            if not token_in or replicas is not None:
                # Read for this call (token-in's generate reports its own versions): a replica
                # whose engine holds other weights than the fleet's is refused here.
                self.engine_before = await self._read_engine_weights()
                if replicas is not None:
                    replicas.check_weights(self.replica, self.engine_before)
            staged = capture.policy.apply(normalized.staged, live.policy)
            await self._guard_context(request, staged)
            rid, attachments = self.rollout_id, normalized.attachments
            if large:
                self.call = await capture.begin_call_offloaded(rid, staged, attachments, size=size)
            else:
                self.call = capture.begin_call(rid, staged, attachments, size=size)
            self.call.replica = self.replica
        except ProxyError as e:
            await self.refuse(e)
            raise
        self.token_in = self.pipeline.goes_token_in(live)
        self._token_in = TokenInCall(self) if self.token_in else None
        self.request = request
        self.info = await self.upstream.info(str(request.get("model", "")))
        self.plan = self._plan()

    async def refuse(self, err: ProxyError) -> None:
        """Record the call as refused with `err` before admission (``rejected`` in the ledger,
        except a 409); `prepare` does it for its own refusals, the caller for earlier ones such
        as a body over the size limit."""
        call_id = await self.capture.refuse(self.rollout_id, err, replica=self.replica)
        if call_id is not None:
            self.outcome = Outcome(
                CallStatus.REJECTED, call_id, err.status, err.body(), err.code, err.message
            )

    async def _guard_context(self, body: dict[str, Any], staged: dict[str, Any]) -> None:
        config = self.pipeline.config
        limit = config.max_model_len
        if not limit:
            return
        key = (
            "max_completion_tokens"
            if body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        wanted = body.get(key)
        prompt_len = await self.upstream.count_prompt_tokens(body)
        room = limit - prompt_len
        if room <= 0:
            raise BadRequest(
                f"the prompt is {prompt_len} tokens: it does not fit the context window of {limit}",
                code="context_overflow",
                param="messages",
            )
        if wanted is None or wanted <= room:
            if wanted is None and config.context_overflow == "cap":
                body[key] = staged[key] = room
            return
        if config.context_overflow == "cap":
            body[key] = staged[key] = room
            return
        raise BadRequest(
            f"{key}={wanted} plus the prompt's {prompt_len} tokens exceeds the context window of "
            f"{limit}; ask for at most {room}",
            code="context_overflow",
            param=key,
        )

    def _plan(self) -> ForwardPlan:
        assert self.call is not None
        start = self.call.experts.start  # an earlier call staged the experts before it
        return self.adapter.plan(self.request, routed_experts_prompt_start=start)

    @property
    def adapter(self) -> VLLMAdapter:
        return self.pipeline.adapter(self.info.reasoning_field)

    @property
    def admitted(self) -> Call:
        if self.call is None or self.plan is None:
            raise RuntimeError("the exchange was not prepared")
        return self.call

    @property
    def streamed(self) -> bool:
        """Whether the client asked for a stream (known once prepared)."""
        return self.plan is not None and self.plan.wants.stream

    @property
    def finished(self) -> bool:
        """The call has its outcome, or staging has begun (it will get one without the client)."""
        call = self.call
        return call is None or call.finished or call.staging

    # -- send --------------------------------------------------------------------------------

    async def send(self) -> Outcome | None:
        """Send the call upstream. None: a 200 is coming, relay it with `read_unary` or
        `relay_stream`. An `Outcome`: the upstream answered an error, recorded and ready to
        relay. Raises `UpstreamFailed` (recorded) when the upstream cannot be reached."""
        call = self.admitted  # raises unless prepared
        assert self.plan is not None
        self._t_up = time.perf_counter()
        if not call.offload:
            # The record's request-side work, done while the upstream generates instead of
            # after its answer. Two loop turns later, not one: the HTTP client writes the
            # request's body from a task it schedules just before this one waits, and the
            # request must leave first.
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self.capture.prepare_record, call)
        try:
            try:
                self._reply = await self._post()
            except UpstreamRestarted:
                # A new upstream process (noticed before anything was sent): plan the call again
                # with its facts (version, reasoning field, fingerprint, defaults), once.
                self.info = await self.upstream.info(str(self.request.get("model", "")))
                if not self.token_in:
                    self.engine_before = await self._read_engine_weights()
                self.plan = self._plan()
                self.pipeline.close_renders.clear()  # its template may differ
                self._reply = await self._post()
        except RenderRefused as e:
            return await self._upstream_error(e.status, e.body)
        except UpstreamFailed as e:
            await self.fail_upstream(e)
            raise
        assert self.plan is not None
        if len(self.plan.body) > OFFLOAD_BYTES:
            # Sent: a large body (an image session's, tens of MiB) is not held while the
            # answer is generated and relayed; the record is built from the decoded request.
            self.plan = replace(self.plan, body=b"")
        if self._reply.status == 200:
            return None
        async with self._reply:
            try:
                raw = await self._reply.read()
            except UpstreamFailed:
                raw = b""
        return await self._upstream_error(self._reply.status, raw)

    async def _post(self) -> UpstreamReply:
        """The upstream's reply to the call: the chat route's, or generate's for token-in."""
        assert self.plan is not None
        if self._token_in is None:
            return await self.upstream.post_chat(self.plan.body)
        return await self._token_in.post()

    async def _upstream_error(self, status: int, raw: bytes) -> Outcome:
        """Record and return the upstream's error answer (`status`, body `raw`) to relay."""
        call = self.admitted
        err = parse_error_body(raw, status)
        message = str(err.get("error", {}).get("message", ""))[:500]
        await self.capture.fail_call(
            call, CallStatus.UPSTREAM_ERROR, f"upstream_{status}", message, status
        )
        return self._ended(
            Outcome(
                CallStatus.UPSTREAM_ERROR,
                call.call_id,
                status,
                orjson.dumps(err),
                f"upstream_{status}",
                message,
            )
        )

    # -- relay -------------------------------------------------------------------------------

    async def read_unary(self) -> Outcome:
        """Read the upstream's 200 answer, then stage it. Raises `UpstreamFailed` (recorded)
        when the answer breaks off or is malformed."""
        assert self._reply is not None
        async with self._reply:
            try:
                raw = await self._reply.read()
            except UpstreamFailed as e:
                await self.fail_upstream(e)
                raise
        if self._token_in is not None:
            return await self._token_in.finish(raw)
        self._upstream_s = time.perf_counter() - self._t_up
        return await self.finish_unary(raw)

    async def finish_unary(self, raw: bytes) -> Outcome:
        """Parse a unary 200 answer and stage it (also the library's entry point)."""
        call, plan = self.admitted, self.plan
        assert plan is not None
        try:
            completion, client_body = self.adapter.parse_response(
                raw, plan, session=call.rollout_id
            )
        except UpstreamProtocolError as e:
            malformed = UpstreamFailed(
                f"the upstream answer is malformed: {e.message}", code=e.reason
            )
            await self.fail_upstream(malformed)
            raise malformed from e
        except CaptureExtractionError as e:
            return await self._not_captured(e, e.client_body or raw)
        return await self._stage(completion, client_body)

    async def relay_stream(self) -> AsyncGenerator[bytes, None]:
        """The bytes to send the client as the upstream's stream arrives; then the call is
        staged and `outcome` is set. An upstream that breaks or stalls ends the iteration with
        an ``upstream_error`` outcome (recorded): the caller must not complete the stream."""
        call, plan = self.admitted, self.plan
        assert plan is not None
        assert self._reply is not None
        if self._token_in is not None:
            async with contextlib.aclosing(self._token_in.relay()) as pieces:
                async for piece in pieces:
                    yield piece
            return
        acc = self.adapter.stream(plan, session=call.rollout_id)
        async with self._reply:
            chunks = self._reply.chunks()
            try:
                async for chunk in chunks:
                    events = acc.feed(chunk)
                    if events:
                        yield b"".join(events)
            except UpstreamFailed as e:
                await self.fail_upstream(e, http_status=502)
                return
            finally:
                if isinstance(chunks, AsyncGenerator):
                    await chunks.aclose()  # its idle timer stops now, not at garbage collection
        try:
            completion = acc.finish()
        except UpstreamProtocolError as e:
            await self.fail_upstream(UpstreamFailed(e.message, code=e.reason), http_status=502)
            return
        except CaptureExtractionError as e:
            await self._not_captured(e, b"")
            return
        await self._stage(completion, b"")

    async def finish_stream(self, raw: bytes) -> Outcome:
        """Stage a whole SSE byte stream received by someone else (the library's entry point)."""
        call, plan = self.admitted, self.plan
        assert plan is not None
        acc = self.adapter.stream(plan, session=call.rollout_id)
        client_body = b"".join(acc.feed(raw))
        try:
            completion = acc.finish()
        except UpstreamProtocolError as e:
            err = UpstreamFailed(e.message, code=e.reason)
            await self.fail_upstream(err, http_status=502)
            assert self.outcome is not None
            return self.outcome
        except CaptureExtractionError as e:
            return await self._not_captured(e, client_body)
        return await self._stage(completion, client_body)

    # -- finish and fail -----------------------------------------------------------------------

    async def _stage(
        self,
        completion: Completion,
        client_body: bytes,
        generated_spans: tuple[WeightSpan, ...] | None = None,
    ) -> Outcome:
        """Stage the call's `completion`; `generated_spans`: a token-in call's weight spans,
        from generate."""
        call = self.admitted
        if self._upstream_s is not None:
            call.upstream_seconds = self._upstream_s
            call.started = self.started
        info = self.info
        if info.problems:
            # A fact is missing from this record ("" fingerprint or version): say why, on it.
            completion.extras["upstream_fact_problems"] = list(info.problems)
        sampling = sampling_of(self.request)
        steps = self._token_in
        prompt = steps.prompt if steps is not None else None
        if prompt is None:
            engine_version, weight_spans = await self._engine_weights(completion)
            effective = effective_sampling(sampling, info.sampling_defaults)
        else:
            assert steps is not None
            engine_version, weight_spans, effective = steps.facts(
                prompt, completion, sampling, generated_spans or ()
            )
        if effective is not None:
            self.pipeline.check_logprobs_mode(effective)
        # Its own task: a client that goes away meanwhile cancels only this wait.
        task = self.pipeline.spawn(
            self.capture.complete_call(
                call,
                completion,
                model=str(self.request.get("model", "")),
                upstream_version=info.version,
                tokenizer_fingerprint=info.fingerprint,
                sampling=sampling,
                logprobs_mode=self.pipeline.config.logprobs_mode,
                effective_sampling=effective,
                engine_weight_version=engine_version,
                weight_spans=weight_spans,
                token_in=prompt is not None,
                bridge_spans=prompt.bridge_spans if prompt is not None else (),
            )
        )
        result: StageResult = await asyncio.shield(task)
        if prompt is not None and result.status is CallStatus.STAGED:
            assert steps is not None
            steps.continued_by_next(completion, prompt)
        status = (
            CallStatus.STAGED if result.status is CallStatus.STAGED else CallStatus.CAPTURE_FAILED
        )
        return self._ended(
            Outcome(
                status,
                call.call_id,
                200,
                client_body,
                result.reason or "",
                result.message or "",
                result,
            )
        )

    async def _engine_weights(
        self, completion: Completion
    ) -> tuple[str | None, list[tuple[str, int, int]]]:
        """The engine's weight version for the call and its span over the completion: known when
        the version read for the call before it was sent equals one read after the answer (one
        request each, only when the upstream serves it), else ``(None, [])``: unknown."""
        before = self.engine_before
        if before is None:
            return None, []
        after = await self._read_engine_weights()
        if after != before:
            return None, []
        n = len(completion.completion_token_ids)
        return before, [(before, 0, n)] if n else []

    async def _read_engine_weights(self) -> str | None:
        """The engine's weight version now (a read sent after this is called), None when the
        upstream does not say."""
        upstream = self.upstream
        if not isinstance(upstream, EngineWeights):
            return None
        return await upstream.read_engine_weight_version()

    async def _not_captured(self, e: CaptureExtractionError, client_body: bytes) -> Outcome:
        """The answer came, but carries no record (missing token ids, ...): capture_failed."""
        call = self.admitted
        await self.capture.fail_call(call, CallStatus.CAPTURE_FAILED, e.reason, e.message)
        return self._ended(
            Outcome(
                CallStatus.CAPTURE_FAILED,
                call.call_id,
                200,
                client_body,
                e.reason,
                e.message,
                StageResult.failed(e.reason, e.message),
            )
        )

    async def fail_upstream(self, err: UpstreamFailed, *, http_status: int | None = None) -> None:
        """Record the call as ``upstream_error`` for `err` (which the client then gets)."""
        call = self.admitted
        status = err.status if http_status is None else http_status
        await self.capture.fail_call(call, CallStatus.UPSTREAM_ERROR, err.code, err.message, status)
        self._ended(
            Outcome(CallStatus.UPSTREAM_ERROR, call.call_id, status, b"", err.code, err.message)
        )

    async def abort(self, reason: str, message: str) -> None:
        """The client went away (or the proxy is shutting down) before the call ended: close
        the upstream request (vLLM aborts the generation) and record ``aborted``."""
        if self._reply is not None:
            self._reply.close()
        call = self.call
        if call is None or call.finished or call.staging:
            return  # already has (or is getting) its outcome
        await self.capture.fail_call(call, CallStatus.ABORTED, reason, message)
        self._ended(Outcome(CallStatus.ABORTED, call.call_id, 499, b"", reason, message))

    def _ended(self, outcome: Outcome) -> Outcome:
        self.outcome = outcome
        return outcome
