"""The aiohttp application: its state, routes and middleware, and the admin application of
``--admin-port``.

One pooled `aiohttp.ClientSession` to the upstream, the sink, the bundled fake vLLM (with
``--upstream fake``) and the background guards are opened and closed through aiohttp's cleanup
context (`lifecycle.py`), so a test or an embedding program gets the same lifecycle as
``capture-proxy serve``.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from ..core.capture import Capture
from ..core.policy import RequestPolicy
from ..core.shared_reader import SharedReader
from ..sinks.base import StagingSink
from ..sinks.registry import open_sink
from .body_rate import BodyRate
from .chat import chat_completions
from .control import add_control_routes
from .fair_share import FairShare
from .lifecycle import lifecycle, mark_shutting_down
from .metrics import Metrics
from .middleware import errors_and_metrics, quiet_parse_errors
from .operator_routes import add_operator_routes, healthz, live_gauges, readyz_brief, store_head
from .passthrough import PASSTHROUGH_PATHS, passthrough
from .read_routes import add_read_routes
from .settings import Settings
from .state import STATE, ProxyState

__all__ = ["create_admin_app", "create_app"]

log = logging.getLogger("capture_proxy")


def create_app(settings: Settings, *, sink: StagingSink | None = None) -> web.Application:
    """The proxy as an aiohttp Application (``sink`` overrides ``settings.store``, for tests)."""
    quiet_parse_errors()
    if sink is not None:
        the_sink = sink
    else:
        started = time.perf_counter()
        the_sink = open_sink(settings.store, linger_s=settings.store_linger)
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
    state.metrics.add_live(lambda: live_gauges(state))
    state.metrics.add_store_head(lambda: store_head(state))
    state.capture.on_outcome.append(state.metrics.observe)
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[errors_and_metrics])
    app[STATE] = state
    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(mark_shutting_down)
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
        add_operator_routes(app)
    return app


def create_admin_app(main: web.Application) -> web.Application:
    """The control API alone, sharing `main`'s state, for ``--admin-port``."""
    admin = web.Application(middlewares=[errors_and_metrics])
    admin[STATE] = main[STATE]
    add_control_routes(admin)
    add_read_routes(admin)
    admin.router.add_get("/healthz", healthz)
    add_operator_routes(admin)
    return admin
