"""Several vLLM replicas of one model behind one proxy: pins, health probes, quarantine.

`ReplicaSet` holds one `HTTPUpstream` per replica and implements
`capture_proxy.core.transport.ReplicaRouter`: the flow asks it once per call which replica the
call's rollout is pinned to (a dictionary lookup; a rollout is placed only when it has no replica
yet, or its replica is lost and rollouts move). Each replica is named by its normalized URL
(``http://host:8000``), the name records carry in ``replica``.

Health is learnt by probing, never on the call path: every replica is asked for ``/health``,
``/version``, the model its ``/v1/models`` names, the tokenizer fingerprint (the fixed probe of
`capture_proxy.upstream.facts` through ``/tokenize``) and its engine's weight version
(``/weight_info``, vLLM's dev mode) every `probe_interval` seconds, and at once when a call could
not reach it. Each round's answers are judged by the agreement rule of
`capture_proxy.upstream.fleet` (the fleet's facts: configured, else a majority; judged again every
round). A replica is

* ``starting`` until its first probe answers (replicas may start after the proxy),
* ``healthy`` when it answers and serves the fleet's facts,
* ``unreachable`` when a probe or a call cannot connect to it (or gets no answer in time),
* ``down`` when it answers but says it cannot serve (``/health`` not 200, no version),
* ``missing_route`` when a route the proxy needs answers 404 (``/tokenize`` on a server that is
  not vLLM's OpenAI server),
* ``wrong_model`` when it serves another model name than the fleet's,
* ``quarantined`` when its vLLM version or tokenizer fingerprint differs from the fleet's,
* ``stale_weights`` when its engine reports another weight version than the fleet's (a replica
  that restarted on old weights after an update): the proxy never relabels it; it takes calls
  once its engine reports the fleet's weights,
* ``held`` when the replicas do not agree and no majority says which is right.

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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..core.call import CallReport
from ..core.transport import UpstreamInfo
from ..errors import UpstreamFailed
from ..schemas.records import CallStatus
from .facts import PROBE_MESSAGES, fingerprint_of
from .fleet import Facts, FleetFacts, ReplicaState, judge
from .http import HTTPUpstream, HTTPUpstreamReply
from .known import UpstreamFacts

__all__ = ["Replica", "ReplicaSet", "ReplicaState", "replica_name"]

log = logging.getLogger("capture_proxy.replicas")

#: The states of a replica that answers with the fleet's model: the engine routes of a weight
#: update (pause, resume) reach them, so that a replica waiting for the fleet's weights is
#: paused and resumed with the others. The version label goes only to healthy ones.
ENGINE_STATES = frozenset({"healthy", "stale_weights", "held"})
#: Failures of a probe request that mean no answer came.
_NO_ANSWER = frozenset({"upstream_unreachable", "upstream_connect_timeout", "upstream_timeout"})

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
    #: Its engine's weight version (``/weight_info``), None when not served or not known.
    weights: str | None = None
    #: time.time() of the last probe's answer (0: never).
    probed_at: float = 0.0
    #: What its last probe said, None when that probe got no full answer.
    facts: Facts | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "replica": self.name,
            "state": self.state,
            "problem": self.problem,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "model": self.model,
            "engine_weight_version": self.weights,
            "probed_at_ms": int(self.probed_at * 1000),
        }


class _ProbeFailed(Exception):
    def __init__(self, state: ReplicaState, message: str) -> None:
        super().__init__(message)
        self.state, self.message = state, message


def _rollout_hash(rollout_id: str) -> int:
    return int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "big")


class ReplicaSet:
    """The replicas at `urls` (each one `HTTPUpstream`, made by `make`), pinned per rollout.

    `move` says what a rollout whose replica is not healthy gets: False, 503
    ``upstream_unavailable``; True, another healthy replica. Call `start` in a running loop to
    begin probing, `close` at the end. Subscribe `observe` to `Capture.on_outcome` so a
    replica a call could not reach is probed (and avoided) at once. `model` is the model name
    every replica must serve (``--served-model``; "": the majority's).
    """

    def __init__(
        self,
        urls: Sequence[str],
        make: Callable[[str], HTTPUpstream],
        *,
        move: bool = False,
        probe_interval: float = 5.0,
        probe_timeout: float = 5.0,
        model: str = "",
    ) -> None:
        self.replicas = [Replica(replica_name(u), make(u)) for u in urls]
        self.by_name = {r.name: r for r in self.replicas}
        self.move = move
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.model = model
        #: The engine weight version this proxy last pushed to the engines (None: none yet):
        #: the fleet's, whatever the majority says.
        self.weights: str | None = None
        #: The facts the fleet agreed on in the last judgement (`capture_proxy.upstream.fleet`).
        self.fleet = FleetFacts()
        #: Bumped by each push of a weight version: a probe round that overlaps one is not judged.
        self._pushes = 0
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
            r.facts = None  # not judged again on its last probe's answers
            self._set(r, "unreachable", f"a call could not reach it ({report.reason})")
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
        self,
        op: Callable[[HTTPUpstream], Awaitable[bool]],
        done: str,
        states: frozenset[str] = frozenset({"healthy"}),
    ) -> dict[str, str]:
        """Run `op` on every replica in one of `states` (default: the healthy ones) at once: per
        replica `done`, ``not_served`` (the route is not served), ``failed: <why>``, or
        ``skipped: <state>`` (in another state)."""

        async def one(r: Replica) -> str:
            if r.state not in states:
                return f"skipped: {r.state}"
            try:
                return done if await op(r.upstream) else "not_served"
            except UpstreamFailed as e:
                log.warning("replica %s: %s failed: %s", r.name, done, e.message)
                return f"failed: {e.message}"

        results = await asyncio.gather(*(one(r) for r in self.replicas))
        return {r.name: res for r, res in zip(self.replicas, results, strict=True)}

    async def push_weight_version(self, version: int) -> dict[str, str]:
        """Push `version` to every healthy replica's ``/update_weight_version`` (as
        `on_healthy`); when any took it, it is the fleet's weight version from then on: a
        replica that missed it (down meanwhile, or its push failed) is ``stale_weights`` until
        its own engine reports it. The label is never pushed to a replica that is not healthy:
        the proxy cannot know which weights a restarted engine holds."""
        self._pushes += 1
        try:
            results = await self.on_healthy(lambda u: u.push_weight_version(version), "updated")
        finally:
            self._pushes += 1
        if any(res == "updated" for res in results.values()):
            label = str(version)
            self.weights = label
            for r in self.replicas:
                if results[r.name] == "updated":
                    r.weights = label
                    if r.facts is not None:
                        r.facts = Facts(r.facts.model, r.facts.version, r.facts.fingerprint, label)
            self._judge()
        return results

    def check_weights(self, name: str, engine_version: str | None) -> None:
        """A call's read of its replica's engine weight version, before it is admitted: a
        version other than the fleet's (an engine that restarted on other weights since the
        last probe) makes the replica ``stale_weights`` at once and refuses the call (503
        ``upstream_unavailable``). None (not served, or the read failed) is left to the
        probes."""
        want = self.fleet.weights
        r = self.by_name.get(name)
        if r is None or want is None or engine_version is None or engine_version == want:
            return
        r.weights = engine_version
        if r.facts is not None:
            r.facts = Facts(r.facts.model, r.facts.version, r.facts.fingerprint, engine_version)
        problem = f"engine weight version {engine_version} where the fleet's is {want}"
        self._set(r, "stale_weights", problem)
        self._wake.set()
        raise self._unavailable(f"replica {name} is stale_weights: {problem}")

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
        """Probe every replica at once, then judge them by the agreement rule."""
        pushes = self._pushes
        await asyncio.gather(*(self._probe(r) for r in self.replicas))
        if self._pushes != pushes:
            # A weight version was pushed meanwhile: the answers may predate it. Judged again
            # by the next round, at once.
            self._wake.set()
            return
        self._judge()
        self.probed.set()

    def _judge(self) -> None:
        answered = [(r.name, r.facts) for r in self.replicas if r.facts is not None]
        if not answered:
            return
        self.fleet, verdicts = judge(answered, model=self.model, weights=self.weights)
        for name, verdict in verdicts.items():
            self._set(self.by_name[name], verdict.state, verdict.problem)

    async def _probe(self, r: Replica) -> None:
        """Ask one replica for its facts (kept on it), or mark why it gave none."""
        up = r.upstream
        try:
            await self._ask(up, "GET", "/health")
            raw_version, raw_models, weights = await asyncio.gather(
                self._ask(up, "GET", "/version"),
                self._ask(up, "GET", "/v1/models"),
                self._weights(up),
            )
            version = orjson.loads(raw_version).get("version")
            if not isinstance(version, str) or not version:
                raise _ProbeFailed("down", "/version answered without a version")
            model = _model_of(raw_models)
            if not model:
                raise _ProbeFailed("down", "/v1/models answered no model")
            body = {"model": model, "messages": PROBE_MESSAGES, "add_generation_prompt": True}
            raw = await self._ask(up, "POST", "/tokenize", orjson.dumps(body))
            fingerprint = fingerprint_of(orjson.loads(raw).get("tokens"))
            if not fingerprint:
                raise _ProbeFailed("down", "/tokenize answered without token ids")
        except _ProbeFailed as e:
            r.facts = None
            self._set(r, e.state, e.message)
            return
        except (orjson.JSONDecodeError, AttributeError) as e:
            r.facts = None
            self._set(r, "down", f"a probe's answer is not what vLLM answers: {e}")
            return
        r.version, r.fingerprint, r.model, r.weights = version, fingerprint, model, weights
        r.probed_at = time.time()
        r.facts = Facts(model, version, fingerprint, weights)

    async def _ask(
        self, up: HTTPUpstream, method: str, path: str, body: bytes | None = None
    ) -> bytes:
        """One probe request's body; `_ProbeFailed` naming the state it shows otherwise."""
        try:
            status, raw = await self._get(up, method, path, body)
        except UpstreamFailed as e:
            state: ReplicaState = "unreachable" if e.code in _NO_ANSWER else "down"
            raise _ProbeFailed(state, e.message) from e
        if status == 404:
            raise _ProbeFailed(
                "missing_route", f"{path} answered 404: not a vLLM OpenAI server's routes"
            )
        if status != 200:
            raise _ProbeFailed("down", f"{path} answered {status}")
        return raw

    async def _weights(self, up: HTTPUpstream) -> str | None:
        """The engine's weight version (``/weight_info``), None when the route is not served
        (vLLM without dev mode); a read that fails says nothing of the weights: the probe fails
        (else one slow answer would look like other weights)."""
        try:
            status, raw = await self._get(up, "GET", "/weight_info")
        except UpstreamFailed as e:
            state: ReplicaState = "unreachable" if e.code in _NO_ANSWER else "down"
            raise _ProbeFailed(state, e.message) from e
        if status == 404:
            return None
        if status != 200:
            raise _ProbeFailed("down", f"/weight_info answered {status}")
        got = orjson.loads(raw).get("weight_version")
        return str(got) if got is not None and got != "" else None

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
        elif state in ("quarantined", "wrong_model", "stale_weights", "held"):
            log.error("replica %s %s: %s; it takes no calls", r.name, state, problem)
        elif was != state:
            log.warning("replica %s is %s: %s", r.name, state, problem)


def _model_of(raw: bytes) -> str:
    """The first model a ``/v1/models`` answer names ("" for none)."""
    try:
        return str(orjson.loads(raw)["data"][0]["id"])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return ""
