"""Several vLLM replicas of one model behind one proxy: pins, health probes, quarantine.

`ReplicaSet` holds one `HTTPUpstream` per replica and implements
`capture_proxy.core.transport.ReplicaRouter`: the flow asks it once per call which replica the
call's rollout is pinned to (a dictionary lookup; a rollout is placed only when it has no replica
yet, or its replica is lost and rollouts move). Each replica is named by its normalized URL
(``http://host:8000``), the name records carry in ``replica``.

Health is learnt by probing, never on the call path: every replica is asked for ``/health``,
``/version`` and the tokenizer fingerprint (the fixed probe of `capture_proxy.upstream.facts`
through ``/tokenize``, for the model its ``/v1/models`` names) every `probe_interval` seconds,
and at once when a call could not reach it. A replica is

* ``starting`` until its first probe answers (replicas may start after the proxy),
* ``healthy`` when it answers and serves the same model as the others,
* ``down`` when a probe or a call cannot reach it,
* ``quarantined`` when its vLLM version or tokenizer fingerprint differs from the fleet's (the
  facts most replicas gave at first contact): its records would not be the same model's.

Only healthy replicas take new rollouts. A call of a rollout pinned to a replica that is not
healthy gets 503 ``upstream_unavailable``, or, when rollouts move (``--on-replica-loss move``),
the rollout is placed again on a healthy one (the flow writes the move to its event log and its
next record names the new replica). Changes of state are logged once, when they happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from ..core.call import CallReport
from ..core.transport import UpstreamInfo
from ..errors import UpstreamFailed
from ..schemas.records import CallStatus
from .facts import PROBE_MESSAGES, fingerprint_of
from .http import HTTPUpstream, HTTPUpstreamReply
from .known import UpstreamFacts

__all__ = ["Replica", "ReplicaSet", "ReplicaState", "replica_name"]

log = logging.getLogger("capture_proxy.replicas")

ReplicaState = Literal["starting", "healthy", "down", "quarantined"]

#: Call failures that say the replica cannot be reached at all: it is marked down at once.
_UNREACHABLE = frozenset({"upstream_unreachable", "upstream_connect_timeout"})
#: Call failures that may mean the replica went away: it is probed at once.
_SUSPECT = _UNREACHABLE | {"upstream_broken", "upstream_idle_timeout"}
#: Shortest pause between two probe rounds, however often calls fail.
_MIN_GAP = 0.05


def replica_name(url: str) -> str:
    """A replica's name: its base URL without a trailing ``/`` or ``/v1`` (as records carry)."""
    return url.rstrip("/").removesuffix("/v1")


@dataclass(slots=True)
class Replica:
    """One replica and what its probes said."""

    name: str
    upstream: HTTPUpstream
    state: ReplicaState = "starting"
    #: Why it is not healthy (one sentence), "" when healthy.
    problem: str = "not probed yet"
    version: str = ""
    fingerprint: str = ""
    model: str = ""
    #: time.time() of the last probe's answer (0: never).
    probed_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "replica": self.name,
            "state": self.state,
            "problem": self.problem,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "model": self.model,
            "probed_at_ms": int(self.probed_at * 1000),
        }


def _rollout_hash(rollout_id: str) -> int:
    return int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "big")


class ReplicaSet:
    """The replicas at `urls` (each one `HTTPUpstream`, made by `make`), pinned per rollout.

    `move` says what a rollout whose replica is not healthy gets: False, 503
    ``upstream_unavailable``; True, another healthy replica. Call `start` in a running loop to
    begin probing, `close` at the end. Subscribe `observe` to `Capture.on_outcome` so a
    replica a call could not reach is probed (and avoided) at once.
    """

    def __init__(
        self,
        urls: Sequence[str],
        make: Callable[[str], HTTPUpstream],
        *,
        move: bool = False,
        probe_interval: float = 5.0,
        probe_timeout: float = 5.0,
    ) -> None:
        self.replicas = [Replica(replica_name(u), make(u)) for u in urls]
        self.by_name = {r.name: r for r in self.replicas}
        self.move = move
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        #: ``(version, fingerprint)`` every replica must serve, set from the first probe round
        #: that reaches any (the facts most replicas gave), and the replica it came from.
        self.fleet: tuple[str, str] | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Set after each probe round (tests and startup wait on it).
        self.probed = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Begin probing (the first round at once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._probe_loop())

    async def first_probes(self) -> None:
        """Wait for the first probe round (bounded: three probe requests' time), so a proxy
        that starts does not refuse calls its replicas could serve."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3 * self.probe_timeout + 1):
                await self.probed.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for r in self.replicas:
            await r.upstream.close()

    # -- routing (ReplicaRouter) -----------------------------------------------------------------

    def route(
        self, rollout_id: str, pinned: str, load: Callable[[], Mapping[str, int]]
    ) -> tuple[str, HTTPUpstream]:
        """The replica for a call of `rollout_id` (see `ReplicaRouter.route`)."""
        if pinned:
            r = self.by_name.get(pinned)
            if r is not None and r.state == "healthy":
                return pinned, r.upstream
            if r is not None and r.state == "starting":
                # Not probed yet (this proxy just started): no reason to move the rollout away.
                raise self._unavailable(
                    f"rollout {rollout_id} is pinned to replica {pinned}, not probed yet"
                )
            if not self.move:
                why = (
                    f"{r.state}: {r.problem}"
                    if r is not None
                    else "not one of this proxy's --upstream replicas"
                )
                raise self._unavailable(
                    f"rollout {rollout_id} is pinned to replica {pinned}, which is {why} "
                    "(--on-replica-loss fail: its calls wait for that replica)"
                )
        healthy = [r for r in self.replicas if r.state == "healthy"]
        if not healthy:
            raise self._unavailable(f"no healthy upstream replica: {self.summary()}")
        counts = load()
        least = min(counts.get(r.name, 0) for r in healthy)
        tied = [r for r in healthy if counts.get(r.name, 0) == least]
        chosen = tied[_rollout_hash(rollout_id) % len(tied)]
        return chosen.name, chosen.upstream

    def _unavailable(self, message: str) -> UpstreamFailed:
        err = UpstreamFailed(message, code="upstream_unavailable", status=503)
        err.headers["Retry-After"] = str(max(1, math.ceil(self.probe_interval)))
        return err

    def summary(self) -> str:
        """Each replica's state in one line (for errors and logs)."""
        return "; ".join(
            f"{r.name} {r.state}" + (f" ({r.problem})" if r.problem else "") for r in self.replicas
        )

    def observe(self, report: CallReport) -> None:
        """A call's outcome (`Capture.on_outcome`): a replica it could not reach is marked down
        and every replica probed at once; one that broke off an answer is probed at once."""
        if not report.replica or report.status is not CallStatus.UPSTREAM_ERROR:
            return
        if report.reason not in _SUSPECT:
            return
        r = self.by_name.get(report.replica)
        if r is not None and report.reason in _UNREACHABLE and r.state == "healthy":
            self._set(r, "down", f"a call could not reach it ({report.reason})")
        self._wake.set()

    # -- the UpstreamTransport of the set: any healthy replica ---------------------------------

    def any_healthy(self) -> HTTPUpstream:
        """A healthy replica's client (for routes no rollout owns: pass-through, the context
        guard); `UpstreamFailed` (503 ``upstream_unavailable``) when there is none."""
        for r in self.replicas:
            if r.state == "healthy":
                return r.upstream
        raise self._unavailable(f"no healthy upstream replica: {self.summary()}")

    async def info(self, model: str) -> UpstreamInfo:
        return await self.any_healthy().info(model)

    async def count_prompt_tokens(self, request: Mapping[str, Any]) -> int:
        return await self.any_healthy().count_prompt_tokens(request)

    async def post_chat(self, body: bytes) -> HTTPUpstreamReply:
        return await self.any_healthy().post_chat(body)

    async def relay(
        self,
        method: str,
        path: str,
        body: bytes | None,
        content_type: str | None,
        *,
        within: float | None = None,
    ) -> tuple[int, str, bytes]:
        """One uncaptured request, to a healthy replica (they serve the same model)."""
        return await self.any_healthy().relay(method, path, body, content_type, within=within)

    @property
    def known(self) -> UpstreamFacts:
        """The facts cache of a healthy replica (the first listed when none is): replicas serve
        the same model, so what one says of it holds for all."""
        for r in self.replicas:
            if r.state == "healthy":
                return r.upstream.known
        return self.replicas[0].upstream.known

    async def scale_out_served(self) -> bool | None:
        """Whether every healthy replica serves vLLM's scale-out routes: False when one does
        not, None while one is unknown (or none is healthy)."""
        healthy = [r for r in self.replicas if r.state == "healthy"]
        if not healthy:
            return None
        got = await asyncio.gather(*(r.upstream.scale_out_served() for r in healthy))
        if False in got:
            return False
        return None if None in got else True

    async def problem(self, within: float = 2.0) -> str | None:
        """Why no call can be served (no healthy replica), or None."""
        if any(r.state == "healthy" for r in self.replicas):
            return None
        return f"no healthy upstream replica: {self.summary()}"

    def fact_problems(self) -> list[str]:
        """What is missing or wrong about the replicas that do not stop the proxy: unhealthy
        ones (while another is healthy) and missing facts of healthy ones."""
        out = []
        for r in self.replicas:
            if r.state != "healthy":
                out.append(f"replica {r.name} is {r.state}: {r.problem}")
            else:
                out += [f"replica {r.name}: {p}" for p in r.upstream.fact_problems()]
        return out

    # -- vLLM's weight-update routes, on every healthy replica -----------------------------------

    async def on_healthy(
        self, op: Callable[[HTTPUpstream], Awaitable[bool]], done: str
    ) -> dict[str, str]:
        """Run `op` on every healthy replica at once: per replica `done`, ``not_served`` (the
        route is not served), ``failed: <why>``, or ``skipped: <state>`` (not healthy)."""

        async def one(r: Replica) -> str:
            if r.state != "healthy":
                return f"skipped: {r.state}"
            try:
                return done if await op(r.upstream) else "not_served"
            except UpstreamFailed as e:
                log.warning("replica %s: %s failed: %s", r.name, done, e.message)
                return f"failed: {e.message}"

        results = await asyncio.gather(*(one(r) for r in self.replicas))
        return {r.name: res for r, res in zip(self.replicas, results, strict=True)}

    # -- probes --------------------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        while True:
            self._wake.clear()
            await self.probe_all()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.probe_interval):
                    await self._wake.wait()
            await asyncio.sleep(_MIN_GAP)

    async def probe_all(self) -> None:
        """Probe every replica at once, then judge them against the fleet's facts."""
        got = await asyncio.gather(*(self._probe(r) for r in self.replicas))
        answered = [(r, facts) for r, facts in zip(self.replicas, got, strict=True) if facts]
        if self.fleet is None and answered:
            # The facts most replicas give (ties: the first in --upstream order) are the fleet's.
            counts = Counter(facts for _, facts in answered)
            self.fleet = max(counts, key=lambda f: counts[f])
        for r, facts in answered:
            assert facts is not None
            assert self.fleet is not None
            if facts == self.fleet:
                self._set(r, "healthy", "")
            else:
                self._set(r, "quarantined", self._differs(facts))
        self.probed.set()

    def _differs(self, facts: tuple[str, str]) -> str:
        assert self.fleet is not None
        version, fingerprint = self.fleet
        parts = []
        if facts[0] != version:
            parts.append(f"vLLM {facts[0]} where the other replicas run {version}")
        if facts[1] != fingerprint:
            parts.append(
                f"tokenizer fingerprint {facts[1][:19]}… differs from the other replicas' "
                f"{fingerprint[:19]}…"
            )
        return "serves another model: " + "; ".join(parts)

    async def _probe(self, r: Replica) -> tuple[str, str] | None:
        """``(version, fingerprint)`` from one replica, or None (it is then marked down)."""
        up = r.upstream
        try:
            status, raw = await self._get(up, "GET", "/health")
            if status != 200:
                raise UpstreamFailed(f"/health answered {status}")
            status, raw = await self._get(up, "GET", "/version")
            version = orjson.loads(raw).get("version") if status == 200 else None
            if not isinstance(version, str) or not version:
                raise UpstreamFailed(f"/version answered {status} without a version")
            if not r.model:
                r.model = await self._model(up)
            body = {"model": r.model, "messages": PROBE_MESSAGES, "add_generation_prompt": True}
            status, raw = await self._get(up, "POST", "/tokenize", orjson.dumps(body))
            fingerprint = fingerprint_of(orjson.loads(raw).get("tokens")) if status == 200 else ""
            if not fingerprint:
                raise UpstreamFailed(f"/tokenize answered {status} without token ids")
        except (UpstreamFailed, orjson.JSONDecodeError, AttributeError) as e:
            message = e.message if isinstance(e, UpstreamFailed) else f"{type(e).__name__}: {e}"
            self._set(r, "down", message)
            return None
        r.version, r.fingerprint, r.probed_at = version, fingerprint, time.time()
        return version, fingerprint

    async def _model(self, up: HTTPUpstream) -> str:
        status, raw = await self._get(up, "GET", "/v1/models")
        try:
            return str(orjson.loads(raw)["data"][0]["id"]) if status == 200 else ""
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return ""

    async def _get(
        self, up: HTTPUpstream, method: str, path: str, body: bytes | None = None
    ) -> tuple[int, bytes]:
        status, _, raw = await up.relay(
            method, path, body, None, within=self.probe_timeout, session=up.facts_session
        )
        return status, raw

    def _set(self, r: Replica, state: ReplicaState, problem: str) -> None:
        """Change a replica's state, logging the change once (never per probe or call)."""
        if (r.state, r.problem) == (state, problem):
            return
        was, r.state, r.problem = r.state, state, problem
        if state == "healthy":
            log.info("replica %s is healthy (was %s)", r.name, was)
        elif state == "quarantined":
            log.error("replica %s quarantined: %s; it takes no calls", r.name, problem)
        elif was != "down" or state != "down":
            log.warning("replica %s is %s: %s", r.name, state, problem)
