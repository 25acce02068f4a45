"""The operator's routes: ``/healthz``, ``/readyz`` (in full, or brief on the sandboxes' port),
``/metrics`` with the live gauges it reads, and vLLM's own metrics relayed."""

from __future__ import annotations

from aiohttp import web

from ..core.token_in import SCALE_OUT_MISSING
from ..schemas.store_head import StoreHead
from ..sinks.store_head import StoreHeadKeeper
from ..upstream.replicas import ReplicaSet
from .state import STATE, ProxyState


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


def store_head(state: ProxyState) -> StoreHead | None:
    """The store head `/metrics` shows, where the sink keeps one."""
    keeper = getattr(state.sink, "store_head", None)  # a store one writer writes (SQLite, local)
    return keeper.current() if isinstance(keeper, StoreHeadKeeper) else None


def live_gauges(state: ProxyState) -> dict[str, float]:
    """The gauges `/metrics` reads at each scrape: in-flight calls, quotas, the sink's queue."""
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


def add_operator_routes(app: web.Application) -> None:
    """``/readyz`` in full and the metrics routes, on the port that serves the control API."""
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/metrics/upstream", upstream_metrics)
