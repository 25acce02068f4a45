"""Prometheus metrics (names follow Prometheus conventions: units in names, `_total` counters).

Each app has its own registry, so several proxies (or tests) in one process do not share counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..core.call import CallReport
from ..core.token_in import TokenInReport
from ..schemas.records import CallStatus
from ..schemas.store_head import StoreHead

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)


class _Live(Collector):
    """Gauges read at scrape time from the running proxy (no bookkeeping on the hot path)."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read = read

    def collect(self):  # type: ignore[no-untyped-def]
        for name, value in self.read().items():
            doc = name.replace("_", " ")
            if name.endswith("_total"):
                family: Any = CounterMetricFamily(f"capture_proxy_{name[:-6]}", doc)
            else:
                family = GaugeMetricFamily(f"capture_proxy_{name}", doc)
            family.add_metric([], value)
            yield family


class _ReplicaStates(Collector):
    """``capture_proxy_replica_healthy{replica, state}``: 1 for a healthy replica, else 0, read
    at scrape time."""

    def __init__(self, read: Callable[[], list[tuple[str, str]]]) -> None:
        self.read = read

    def collect(self):  # type: ignore[no-untyped-def]
        family = GaugeMetricFamily(
            "capture_proxy_replica_healthy",
            "1 when the upstream replica is healthy, else 0 (state: starting, healthy, "
            "unreachable, down, missing_route, wrong_model, quarantined, stale_weights, held)",
            labels=["replica", "state"],
        )
        for name, state in self.read():
            family.add_metric([name, state], 1.0 if state == "healthy" else 0.0)
        yield family


class _StoreHead(Collector):
    """``capture_proxy_store_head_info{head, rollouts, events, claims}`` (always 1) and
    ``capture_proxy_store_head_rollouts``: the store head the sink's writer is at, read at
    scrape time (docs/digest.md, "The store head"); nothing for a sink that keeps none."""

    def __init__(self, read: Callable[[], StoreHead | None]) -> None:
        self.read = read

    def collect(self):  # type: ignore[no-untyped-def]
        head = self.read()
        if head is None:
            return
        info = GaugeMetricFamily(
            "capture_proxy_store_head_info",
            "the store head (a hash over every rollout's chain head) after the writer's last "
            "commit; keep the last one to check the store with inspect --verify "
            "--expected-store-head HEAD:ROLLOUTS:EVENTS[:CLAIMS] (claims: when not 0)",
            labels=["head", "rollouts", "events", "claims"],
        )
        info.add_metric([head.head, str(head.rollouts), str(head.events), str(head.claims)], 1.0)
        yield info
        count = GaugeMetricFamily(
            "capture_proxy_store_head_rollouts", "rollouts the store head covers"
        )
        count.add_metric([], float(head.rollouts))
        yield count


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "capture_proxy_requests_total",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.calls = Counter(
            "capture_proxy_calls_total",
            "chat calls by outcome (staged, capture_failed, rejected, upstream_error, aborted) "
            "and reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "capture_proxy_request_duration_seconds",
            "time from request to last byte, by route",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_seconds = Histogram(
            "capture_proxy_upstream_duration_seconds",
            "time the upstream took (request sent to last byte received)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead_seconds = Histogram(
            "capture_proxy_overhead_duration_seconds",
            "time a chat call spent in the proxy itself (total minus upstream)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "capture_proxy_stage_duration_seconds",
            "time to stage a record durably",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.staged_tokens = Counter(
            "capture_proxy_staged_tokens_total",
            "prompt + completion tokens in staged records",
            registry=r,
        )
        self.staged_records = Counter(
            "capture_proxy_staged_records_total", "records staged durably", registry=r
        )
        self.staged_token_bytes = Counter(
            "capture_proxy_staged_token_bytes_total",
            "bytes of token ids stored (4 a token, after the prefix shared with the parent)",
            registry=r,
        )
        self.attachments = Counter(
            "capture_proxy_attachments_total", "attachments staged with calls", registry=r
        )
        self.token_in_calls = Counter(
            "capture_proxy_token_in_calls_total",
            "token-in calls by result (extended: the prompt extended the previous call's tokens; "
            "new_segment: the plain rendering was sent) and the new segment's reason",
            ["result", "reason"],
            registry=r,
        )
        self.token_in_diverged = Counter(
            "capture_proxy_token_in_plain_divergence_total",
            "token-in calls whose plain rendering would have differed from the tokens sent "
            "(what token-in avoided)",
            registry=r,
        )
        self.token_in_placed = Counter(
            "capture_proxy_token_in_placed_total",
            "extended token-in calls by how their appended tokens were placed: rendering (the "
            "request's own render alone) or dummies (the bridge's dummy renders)",
            ["by"],
            registry=r,
        )
        self.token_in_beside = Counter(
            "capture_proxy_token_in_beside_total",
            "token-in calls whose generate was sent beside the request's own render "
            "(--token-in-beside): passed (kept) or the reason it was aborted and sent again "
            "(prompt, max_tokens, sampling, request)",
            ["result"],
            registry=r,
        )
        # With several upstream replicas (a call's `replica` set): per-replica copies of the
        # metrics that tell a replica apart, so a single upstream's series stay as they are.
        self.replica_calls = Counter(
            "capture_proxy_replica_calls_total",
            "chat calls sent to each upstream replica, by outcome",
            ["replica", "outcome"],
            registry=r,
        )
        self.replica_upstream_seconds = Histogram(
            "capture_proxy_replica_upstream_duration_seconds",
            "time each upstream replica took (request sent to last byte received)",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.replica_upstream_errors = Counter(
            "capture_proxy_replica_upstream_errors_total",
            "calls that failed at an upstream replica, by reason",
            ["replica", "reason"],
            registry=r,
        )
        self.streams_open = Gauge(
            "capture_proxy_streams_open", "streamed responses in progress", registry=r
        )

    def observe(self, report: CallReport) -> None:
        """Count one call's outcome (subscribed to `Capture.on_outcome`)."""
        self.calls.labels(report.status, report.reason).inc()
        if report.status is CallStatus.STAGED and report.coords is not None:
            self.staged_records.inc()
            self.staged_tokens.inc(report.coords.cum_len)
            self.staged_token_bytes.inc(4 * report.coords.delta_len)
        if report.attachments:
            self.attachments.inc(report.attachments)
        if report.stage_seconds is not None:
            self.stage_seconds.observe(report.stage_seconds)
        if report.upstream_seconds is not None:
            self.upstream_seconds.observe(report.upstream_seconds)
        if report.overhead_seconds is not None:
            self.overhead_seconds.observe(report.overhead_seconds)
        if report.replica:
            self._observe_replica(report)

    def _observe_replica(self, report: CallReport) -> None:
        self.replica_calls.labels(report.replica, report.status).inc()
        if report.upstream_seconds is not None:
            self.replica_upstream_seconds.labels(report.replica).observe(report.upstream_seconds)
        if report.status is CallStatus.UPSTREAM_ERROR:
            self.replica_upstream_errors.labels(report.replica, report.reason).inc()

    def observe_token_in(self, report: TokenInReport) -> None:
        """Count one token-in call (subscribed to `Pipeline.on_token_in`)."""
        self.token_in_calls.labels(report.result, report.reason).inc()
        if report.plain_divergence is not None:
            self.token_in_diverged.inc()
        if report.beside:
            self.token_in_beside.labels(report.beside).inc()
        if report.placed:
            self.token_in_placed.labels(report.placed).inc()

    def add_live(self, read: Callable[[], dict[str, float]]) -> None:
        self.registry.register(_Live(read))

    def add_replica_states(self, read: Callable[[], list[tuple[str, str]]]) -> None:
        """Report each upstream replica's state (several upstreams only)."""
        self.registry.register(_ReplicaStates(read))

    def add_store_head(self, read: Callable[[], StoreHead | None]) -> None:
        """Report the sink writer's store head."""
        self.registry.register(_StoreHead(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)
