"""The aiohttp application: routes, error middleware, and the lifecycle of its resources.

One pooled `aiohttp.ClientSession` to the upstream, the sink, the bundled fake vLLM (with
``--upstream fake``) and the background guards are opened and closed through aiohttp's cleanup
context, so a test or an embedding program gets the same lifecycle as ``capture-proxy serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..core.capture import Capture
from ..core.journal import journal_path, release_reserve, replay_journal, reserve_journal
from ..core.pipeline import ExchangeConfig, Pipeline
from ..core.policy import RequestPolicy
from ..core.shared_reader import SharedReader
from ..core.token_in import SCALE_OUT_MISSING
from ..errors import (
    CaptureUnavailable,
    NotFound,
    PayloadTooLarge,
    ProxyError,
    RequestTimeout,
    error_body,
)
from ..schemas.request import FreeJsonLimits
from ..schemas.store_head import StoreHead
from ..sinks.base import StagingSink, StoreError
from ..sinks.registry import open_sink, store_local_dir
from ..sinks.store_head import StoreHeadKeeper
from ..upstream.http import HTTPUpstream
from ..upstream.replicas import ReplicaSet
from .body_rate import BodyRate
from .chat import chat_completions
from .control import add_control_routes
from .fair_share import FairShare
from .loop_lag import LoopLag
from .metrics import Metrics
from .passthrough import PASSTHROUGH_PATHS, passthrough
from .read_routes import add_read_routes
from .settings import Settings
from .state import STATE, ProxyState

__all__ = ["create_admin_app", "create_app"]

log = logging.getLogger("capture_proxy")
access_log = logging.getLogger("capture_proxy.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _route_label(request: web.Request) -> str:
    info = request.match_info
    if info.http_exception is not None or info.route.resource is None:
        return "unmatched"
    return info.route.resource.canonical


def _log_access(
    state: ProxyState,
    request: web.Request,
    route: str,
    status: int,
    elapsed: float,
    headers: Mapping[str, str],
) -> None:
    """One line per request with its rollout, call id and capture outcome (never the body)."""
    call_id = headers.get("X-Capture-Call-Id")
    rollout_id = (
        request.match_info.get("rollout_id")
        or request.headers.get("X-Rollout-Id")
        or request.headers.get("x-session-id")
    )
    outcome = headers.get("X-Capture-Status")
    live = state.capture.rollouts.get(rollout_id or "anonymous") if call_id else None
    if live is not None and call_id in live.outcomes:
        outcome = str(live.outcomes[call_id].status)  # a stream's final outcome, not "pending"
    access_log.info(
        "%s %s %d",
        request.method,
        route,
        status,
        extra={
            "route": route,
            "http_status": status,
            "duration_ms": round(elapsed * 1000, 2),
            "rollout_id": rollout_id if call_id else None,
            "call_id": call_id,
            "status": outcome,
        },
    )


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One JSON error body for every error; requests counted by route and status."""
    state = request.app[STATE]
    started = time.perf_counter()
    route = _route_label(request)
    response: web.StreamResponse | None = None
    try:
        limit = state.settings.max_body_bytes
        length = request.content_length
        if (
            length is not None
            and length > limit
            and request.match_info.handler is not chat_completions
        ):
            # Every route refuses an oversized body from its header, before reading a byte (the
            # chat route does it itself, so that its ledger records the refused call).
            raise PayloadTooLarge(
                f"request body of {request.content_length} bytes is over the limit of {limit} "
                "bytes",
                code="body_too_large",
            )
        if request.body_exists and request.match_info.handler is not chat_completions:
            response = await _with_body_deadline(
                request, handler, state.settings.client_body_timeout
            )
        else:
            response = await handler(request)
        return response
    except ProxyError as e:
        response = web.Response(
            status=e.status, body=e.body(), content_type="application/json", headers=e.headers
        )
        return response
    except StoreError as e:
        # The store itself failed under a handler that reads or writes it directly (the control
        # API, the read routes): its sentence, as a 503, never a bare 500 with a traceback.
        log.error("%s %s: the store failed: %s", request.method, request.path, e)
        down = CaptureUnavailable(
            f"the store is unavailable: {e}", code="store_unavailable", headers={"Retry-After": "5"}
        )
        response = web.Response(
            status=down.status,
            body=down.body(),
            content_type="application/json",
            headers=down.headers,
        )
        return response
    except web.HTTPException as e:
        if e.status == 404:
            err: ProxyError = NotFound(
                f"{request.method} {request.path} is not a route of capture-proxy: only "
                "/v1/chat/completions is captured (plus /v1/models, /tokenize, /detokenize, "
                "/version passed through); nothing is proxied uncaptured",
                code="route_not_found",
            )
            response = web.Response(status=404, body=err.body(), content_type="application/json")
            return response
        if e.status == 405:
            response = web.Response(
                status=405,
                body=error_body(
                    f"{request.method} is not allowed on {request.path}",
                    type="invalid_request_error",
                    code="method_not_allowed",
                ),
                content_type="application/json",
                headers={"Allow": e.headers.get("Allow", "")},
            )
            return response
        response = e  # aiohttp's HTTPException is a response: log its status
        raise
    finally:
        elapsed = time.perf_counter() - started
        status = response.status if response is not None else 500
        state.metrics.requests.labels(route, str(status)).inc()
        state.metrics.request_seconds.labels(route).observe(elapsed)
        if access_log.isEnabledFor(logging.INFO):
            headers = response.headers if response is not None else {}
            _log_access(state, request, route, status, elapsed, headers)


async def _with_body_deadline(
    request: web.Request, handler: Handler, within: float
) -> web.StreamResponse:
    """Run `handler` with a deadline on the request's body: all of it must have arrived within
    `within` seconds of the head (408 otherwise), however the handler reads it. The deadline
    is lifted the moment the last byte arrives, so a slow handler is not cut short. (The chat
    route has its own, so that its ledger records the refused call.)"""
    deadline = asyncio.timeout(within)
    active = True

    def lift() -> None:
        if active and not deadline.expired():
            deadline.reschedule(None)

    try:
        async with deadline:
            request.content.on_eof(lift)
            return await handler(request)
    except TimeoutError as e:
        if not deadline.expired():
            raise
        raise RequestTimeout(
            f"the request body did not arrive within {within:g}s (--client-body-timeout)",
            code="body_timeout",
        ) from e
    finally:
        active = False


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when the upstream answers, the sink is writable, and no ledger entry is held.

    ``warnings`` lists what makes records less than they should be without making the proxy
    unable to capture (a missing upstream fact, raw logprobs under a sampling that changes the
    distribution): they do not fail readiness, since every record states them and a fleet
    should not stop serving over them."""
    state = request.app[STATE]
    problems: list[str] = []
    upstream_problem = await state.upstream.problem()
    if upstream_problem:
        problems.append(upstream_problem)
    cap = state.capture
    if cap.unavailable_reason:
        problems.append(cap.unavailable_reason)
    wants_token_in = not upstream_problem and _wants_token_in(state)
    if wants_token_in and await state.upstream.scale_out_served() is False:
        problems.append(SCALE_OUT_MISSING)
    if cap.sink_failing:
        problems.append(f"sink failing: {cap.sink_failing}")
    if cap.stager.late_writes:
        problems.append(f"{cap.stager.late_writes} staging writes past their deadline (sink slow)")
    if cap.ledger.late:
        problems.append(f"{cap.ledger.late} ledger writes past their deadline (sink slow)")
    if cap.ledger.held:
        problems.append(f"{len(cap.ledger.held)} ledger entries held in memory (sink failing)")
    warnings = [*state.upstream.fact_problems(), *state.pipeline.warnings.values()]
    body: dict[str, object] = {"ready": not problems, "problems": problems, "warnings": warnings}
    if isinstance(state.upstream, ReplicaSet):
        body["replicas"] = [r.to_dict() for r in state.upstream.replicas]
        body["fleet"] = state.upstream.fleet.to_dict()
    return web.json_response(body, status=503 if problems else 200)


async def readyz_brief(request: web.Request) -> web.Response:
    """``/readyz`` on the sandboxes' port when the control API has a port of its own: the same
    status, but only ``{"ready": bool}``. What it leaves out (problems naming the upstream's URL,
    the replicas' URLs, versions and models, warnings) is on the control port's ``/readyz``,
    next to ``/metrics``: sandboxes run model-written code and need none of it."""
    full = await readyz(request)
    return web.json_response({"ready": full.status == 200}, status=full.status)


async def upstream_metrics(request: web.Request) -> web.Response:
    """vLLM's own ``/metrics`` relayed (``/metrics/upstream``), so Prometheus needs no way to
    vLLM's port, where dev mode serves routes without authentication (``/pause``, RPC into the
    engine). With several replicas, one of them answers (each pod's proxy has its own vLLM in
    the deployment files)."""
    status, content_type, raw = await request.app[STATE].upstream.relay(
        "GET", "/metrics", None, None
    )
    return web.Response(status=status, body=raw, headers={"Content-Type": content_type})


def _wants_token_in(state: ProxyState) -> bool:
    """``--token-in on``, or a rollout in memory that chose token-in for itself."""
    if state.settings.token_in == "on":
        return True
    return any(live.token_in for live in state.capture.rollouts.values())


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[STATE].metrics.render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


def _disk_problem(folder: str, floor: int) -> str | None:
    """Why the store's disk is below the floor, or None. Blocking: run it on a thread."""
    probe = folder
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe).free
    except OSError as e:
        return f"cannot read free disk at {probe}: {e}"
    if free < floor:
        mib = 2**20
        return f"free disk at the store ({free // mib} MiB) is below the floor ({floor // mib} MiB)"
    return None


async def _guards(state: ProxyState, store_url: str) -> None:
    """Once a second: the free-disk floor, the sink's own problem (a SQLite file deleted or
    replaced under it), a probe write while the sink is failing, ledger entries the sink
    refused, idle rollouts."""
    floor = state.settings.min_free_disk_mb * 2**20
    folder = store_local_dir(store_url)  # the store kind's local folder; None: not on a disk
    # Optional on sinks, like `stats`: blocking (a stat), so asked from a thread.
    sink_problem = getattr(state.sink, "problem", None)
    while True:
        if floor and folder:
            state.capture.unavailable_reason = await asyncio.to_thread(_disk_problem, folder, floor)
        problem = await asyncio.to_thread(sink_problem) if callable(sink_problem) else None
        if problem:
            # The sink-failure path: /readyz fails naming it, writes already fail with it.
            state.capture.stager.sink_failing = problem
        elif state.capture.stager.sink_failing:
            await _probe_sink(state)
        if state.capture.ledger.held:
            await state.capture.ledger.flush()
        state.pipeline.forget_rollouts(
            state.capture.evict_idle(state.settings.rollout_idle_timeout)
        )
        await asyncio.sleep(1.0)


async def _follow_weight_version(state: ProxyState) -> None:
    """Every ``--weight-version-refresh`` seconds, the weight version the store last recorded:
    several proxies on one store stamp the version any of them set, within that bound."""
    while True:
        await asyncio.sleep(state.settings.weight_version_refresh)
        await state.capture.refresh_weight_version()


async def _probe_sink(state: ProxyState) -> None:
    """Clear the sink's failure once a probe write succeeds (optional on sinks, like `stats`).

    Without it, readiness failed by a full disk came back only when a call staged: behind a
    Kubernetes Service that had taken the pod out of rotation, no call ever came."""
    probe = getattr(state.sink, "probe", None)
    if not callable(probe):
        return
    try:
        async with asyncio.timeout(state.settings.stage_timeout):
            await probe()
    except Exception as e:  # still failing: say the newest reason
        state.capture.stager.sink_failing = f"{type(e).__name__}: {e}"
        return
    log.info("the store takes writes again (a probe write succeeded): ready to capture")
    state.capture.stager.sink_failing = None


def _store_head(state: ProxyState) -> StoreHead | None:
    keeper = getattr(state.sink, "store_head", None)  # a store one writer writes (SQLite, local)
    return keeper.current() if isinstance(keeper, StoreHeadKeeper) else None


def _live_gauges(state: ProxyState) -> dict[str, float]:
    cap = state.capture
    out: dict[str, float] = {
        "inflight_calls": cap.inflight,
        "pending_stages": cap.pending_stages,
        "ledger_held_entries": len(cap.ledger.held),
        "late_writes": cap.stager.late_writes + cap.ledger.late,
        "rollouts_live": len(cap.rollouts),
        "weight_version": cap.weight_version,
        "ready_capture": 0 if (cap.unavailable_reason or cap.sink_failing) else 1,
    }
    # Quota usage without a label per rollout (ids are unbounded): the largest among live
    # rollouts, next to the limits; refusals are counted by reason in calls_total.
    live = cap.rollouts.values()
    out["rollout_calls_used_max"] = max((r.calls_used for r in live), default=0)
    out["rollout_bytes_used_max"] = max(
        (r.bytes_staged + r.bytes_reserved for r in live), default=0
    )
    out["stale_rollout_moves_total"] = cap.handback.moves + cap.ledger.moved
    # Calls waiting for a fair turn now, and since start those that waited and those refused.
    out["fair_share_waiting"] = state.fair_share.waiting
    out["fair_share_waited_total"] = state.fair_share.waited
    out["fair_share_refused_total"] = state.fair_share.refused
    if cap.resumes is not None:
        out["rollout_resumes_total"] = cap.resumes.started
        out["rollout_resume_timeouts_total"] = cap.resumes.timeouts
        out["rollout_resume_failures_total"] = cap.resumes.failures
        out["rollout_resume_slowest_seconds"] = cap.resumes.slowest_s
    out["rollout_calls_limit"] = cap.max_rollout_calls
    out["rollout_bytes_limit"] = cap.max_rollout_bytes
    sink_stats = getattr(state.sink, "stats", None)  # optional: sinks with a write queue
    if callable(sink_stats):
        out.update({f"sink_{k}": v for k, v in sink_stats().items()})
    return out


class _OneLineParseErrors(logging.Filter):
    """aiohttp logs a request it cannot parse (an over-long URL or header, a malformed request
    line) with a full traceback, once per request: a sandbox could fill the log with them. Keep
    one warning line naming the refusal (the client got aiohttp's 400) and drop the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = " ".join(str(exc.message or type(exc).__name__).split())[:160]
            record.msg = "refused a malformed request (%d): %s"
            record.args = (exc.code, reason)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _quiet_parse_errors() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _OneLineParseErrors) for f in server_log.filters):
        server_log.addFilter(_OneLineParseErrors())


def create_app(settings: Settings, *, sink: StagingSink | None = None) -> web.Application:
    """The proxy as an aiohttp Application (``sink`` overrides ``settings.store``, for tests)."""
    _quiet_parse_errors()
    if sink is not None:
        the_sink = sink
    else:
        started = time.perf_counter()
        the_sink = open_sink(settings.store)
        # Said at every start: on object storage the open (the listing of the commit markers,
        # the index of the live units) is most of the time a restarted proxy takes to be ready.
        log.info("store %s opened in %.2f s", settings.store, time.perf_counter() - started)
    state = ProxyState(
        settings=settings,
        sink=the_sink,
        capture=Capture(
            the_sink,
            stage_timeout=settings.stage_timeout,
            max_pending=settings.max_pending_stages,
            max_inflight=settings.max_inflight,
            max_inflight_per_rollout=settings.max_inflight_per_rollout,
            max_rollout_calls=settings.max_rollout_calls,
            max_rollout_bytes=settings.max_rollout_bytes,
            max_rollout_refusal_rows=settings.max_rollout_refusal_rows,
            max_live_rollouts=settings.max_live_rollouts,
            pause_hold=settings.pause_hold_seconds,
            resume_timeout=settings.rollout_resume_timeout,
            source=SharedReader(the_sink),
            policy=RequestPolicy(
                defaults=settings.policy_defaults,
                force=settings.policy_force,
                max_tokens_cap=settings.max_tokens_cap,
                model=settings.served_model,
            ),
        ),
        metrics=Metrics(),
    )
    state.body_rate = BodyRate(settings.max_rollout_body_rate * 2**20, 2 * settings.max_body_bytes)
    state.fair_share = FairShare(
        settings.fair_share_inflight, settings.fair_share_queue, settings.fair_share_wait
    )
    state.metrics.add_live(lambda: _live_gauges(state))
    state.metrics.add_store_head(lambda: _store_head(state))
    state.capture.on_outcome.append(state.metrics.observe)
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[errors_and_metrics])
    app[STATE] = state
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_mark_shutting_down)
    for prefix in ("", "/r/{rollout_id}"):
        app.router.add_post(prefix + "/v1/chat/completions", chat_completions)
        for path in PASSTHROUGH_PATHS:
            method = "POST" if path in ("/tokenize", "/detokenize") else "GET"
            app.router.add_route(method, prefix + path, passthrough)
    app.router.add_get("/healthz", healthz)
    if settings.admin_port:
        # The operator's view (the control API, metrics, readiness in detail) on its own port.
        app.router.add_get("/readyz", readyz_brief)
    else:
        add_control_routes(app)
        add_read_routes(app)
        _add_operator_routes(app)
    return app


def _add_operator_routes(app: web.Application) -> None:
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/metrics/upstream", upstream_metrics)


async def _mark_shutting_down(app: web.Application) -> None:
    app[STATE].shutting_down = True


def create_admin_app(main: web.Application) -> web.Application:
    """The control API alone, sharing `main`'s state, for ``--admin-port``."""
    admin = web.Application(middlewares=[errors_and_metrics])
    admin[STATE] = main[STATE]
    add_control_routes(admin)
    add_read_routes(admin)
    admin.router.add_get("/healthz", healthz)
    _add_operator_routes(admin)
    return admin


async def _replay(state: ProxyState, journal: str) -> None:
    """Before serving: the ledger entries a previous run could not store go into the store
    (raises `StoreError`, so the proxy does not start, if the store refuses them)."""
    reader = SharedReader(state.sink)
    try:
        done = await replay_journal(state.sink, reader(), journal)
    finally:
        reader.close()
    log.warning(
        "replayed the ledger journal %s into the store: %d entries written, %d already there, "
        "%d refused (logged)",
        journal,
        done.written,
        done.already,
        done.refused,
    )


async def _spill(state: ProxyState, journal: str | None) -> None:
    """At exit: ledger entries the store never took go to the journal (or stderr), loudly.

    `serve` exits with status 1 when any did (`LedgerWriter.unsaved`)."""
    ledger = state.capture.ledger
    await asyncio.sleep(0)  # late ledger writes that failed at close are held by now
    spilled = await asyncio.to_thread(ledger.spill, journal)
    if ledger.unsaved:
        lost = f"; {ledger.dropped} more were lost (over the held limit)" if ledger.dropped else ""
        replay = (
            "it is replayed into the store when the proxy starts again on it"
            if ledger.spilled_to == journal
            else f"save them to a file and run: capture-proxy replay-ledger {state.sink.url} FILE"
        )
        log.error(
            "%d ledger entries never reached the store: written to %s (%s)%s; exit status 1",
            spilled,
            ledger.spilled_to or "nowhere",
            replay,
            lost,
        )


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    s = state.settings
    fake_runner: web.AppRunner | None = None
    upstream_url = s.upstream
    if upstream_url == "fake":
        from ..testing.fake_vllm import serve_fake

        _, fake_runner, upstream_url = await serve_fake(host="127.0.0.1", port=0)
        log.info("serving the bundled fake vLLM at %s", upstream_url)
    state.upstream_url = upstream_url

    def client(url: str) -> HTTPUpstream:
        return HTTPUpstream(
            url,
            api_key=s.upstream_api_key,
            reasoning_field=s.upstream_reasoning_field,
            connect_timeout=s.upstream_connect_timeout,
            first_byte_timeout=s.upstream_first_byte_timeout,
            idle_timeout=s.upstream_idle_timeout,
            total_timeout=s.upstream_total_timeout,
        )

    if len(s.upstreams) > 1:
        replicas = ReplicaSet(
            s.upstreams,
            client,
            move=s.on_replica_loss == "move",
            probe_interval=s.replica_probe_interval,
            model=s.served_model,
        )
        state.upstream = replicas
        state.capture.on_outcome.append(replicas.observe)
        state.metrics.add_replica_states(lambda: [(r.name, r.state) for r in replicas.replicas])
        replicas.start()
        await replicas.first_probes()
        log.info("%d upstream replicas: %s", len(s.upstreams), ", ".join(s.upstreams))
    else:
        state.upstream = client(upstream_url)
    state.pipeline = Pipeline(
        state.capture,
        state.upstream,
        ExchangeConfig(
            allow_remote_media=s.allow_remote_media,
            max_model_len=s.max_model_len,
            context_overflow="cap" if s.context_overflow == "cap" else "refuse",
            free_json=FreeJsonLimits(s.max_free_json_bytes, s.max_free_json_items),
            max_json_items=s.max_json_items,
            max_decoding_bytes=s.max_decoding_bytes,
            logprobs_mode=s.upstream_logprobs_mode,
            token_in=s.token_in,
            token_in_upstream_bound=s.token_in_upstream_bound,
        ),
    )
    state.pipeline.on_token_in.append(state.metrics.observe_token_in)
    if s.upstream_logprobs_mode != "processed_logprobs":
        # Said at start, before any call: the effective sampling is known only once the upstream
        # is reached (then /readyz names it, see Pipeline.check_logprobs_mode).
        log.warning(
            "upstream logprobs mode is %s (--upstream-logprobs-mode): when the effective "
            "sampling changes the distribution (temperature != 1, top_p < 1, top_k > 0, "
            "penalties, the model's own generation-config defaults included) the recorded "
            "logprobs are not those of the distribution sampled from; for training start vLLM "
            "with --logprobs-mode processed_logprobs and declare it here",
            s.upstream_logprobs_mode,
        )
    journal = journal_path(state.sink.url)
    if journal is not None and await asyncio.to_thread(os.path.exists, journal):
        await _replay(state, journal)
    # Before serving: a journal that a full disk would need at shutdown is written in space
    # taken now (core/journal.py).
    unreserved = await asyncio.to_thread(reserve_journal, journal)
    if unreserved:
        log.error("%s: ledger entries held at a stop may then go to stderr only", unreserved)
    # The sink's open listed the store moments ago: on object storage listing it again is a
    # request per thousand commit markers, seconds on a large dataset, and the version is only
    # promised within --weight-version-refresh anyway.
    version = await state.capture.restore_weight_version(listed_within_s=s.weight_version_refresh)
    if version:
        log.info("weight version %d, as last set on the store", version)
    guards = asyncio.create_task(_guards(state, s.store))
    follow = asyncio.create_task(_follow_weight_version(state))
    lag = LoopLag()
    state.metrics.add_live(lag.gauges)
    probe = asyncio.create_task(lag.run())
    try:
        yield
    finally:
        for task in (guards, follow, probe):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await state.pipeline.wait_background(s.stage_timeout)
        await state.capture.drain(s.stage_timeout)
        await state.capture.ledger.flush()
        # Readers first: the writer's close then folds the WAL into the file (SQLite).
        if isinstance(state.capture.source, SharedReader):
            state.capture.source.close()
        await state.sink.close()
        incomplete = getattr(state.sink, "incomplete", None)  # SQLite: its WAL not folded in
        state.store_incomplete = incomplete if isinstance(incomplete, str) else None
        await _spill(state, journal)
        if not state.capture.ledger.unsaved:
            await asyncio.to_thread(release_reserve, journal)
        await state.upstream.close()
        if fake_runner is not None:
            await fake_runner.cleanup()
