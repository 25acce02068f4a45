"""What the proxy knows about its upstream process, and when to ask again.

Facts (version, tokenizer fingerprint, sampling defaults) are asked for lazily — a sidecar may
start before vLLM is up — and kept until the upstream process changes. A new process is noticed
two ways: a connection failure (`UpstreamFacts.forget`), and a check when a new connection opens
for a chat call (`UpstreamFacts.verify`, called by `capture_proxy.upstream.connector`): a server
restart closes every connection, so a call that reuses a pooled connection still talks to the
process its facts came from, and a call on a new connection may not. That check asks for the
facts again (in parallel, about one round trip, only when a connection opens) and, when they
differ from those the call was planned with, raises `UpstreamRestarted` before the request is
sent.

A fact that could not be fetched is asked for again after `RETRY_SECONDS`, not kept as unknown.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from ..core.transport import UpstreamInfo, UpstreamRestarted
from ..errors import UpstreamFailed
from .facts import (
    PROBE_MESSAGES,
    fingerprint_of,
    reasoning_field_for,
    sampling_defaults_of,
    scale_out_served,
)

__all__ = ["RETRY_SECONDS", "ModelFacts", "UpstreamFacts"]

log = logging.getLogger("capture_proxy.upstream")

#: Facts are asked for again after this long even without a new process (a safety net).
REFRESH_SECONDS = 300.0
#: A fact that could not be fetched is asked for again after this long: often enough that a
#: quick upstream hiccup does not leave records without it for minutes, seldom enough that an
#: upstream whose route hangs does not hold every call for the fact timeout.
RETRY_SECONDS = 5.0
#: Facts kept, by model name. The name is the client's choice (a sandbox may send a new one with
#: every call): the least recently used are dropped and fetched again if seen.
MODELS_KEPT = 32

#: ``(method, path, body, within)`` → ``(status, body)``; raises `UpstreamFailed`.
Fetch = Callable[[str, str, bytes | None, float], Awaitable[tuple[int, bytes]]]

#: The facts a call was planned with, for the check when its connection opens: set by `info` in
#: the task that then posts the call (aiohttp opens the connection in that same task).
_PLANNED: contextvars.ContextVar[tuple[str, UpstreamInfo] | None] = contextvars.ContextVar(
    "capture_proxy_planned_facts", default=None
)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the upstream said about one model: its tokenizer fingerprint ("" unknown) and the
    sampling defaults it fills in (None: the render route is not served, or failed)."""

    fingerprint: str
    sampling_defaults: Mapping[str, Any] | None
    problem: str
    fetched_at: float
    #: Whether the render route answered (vLLM's scale-out routes are served); None: unknown.
    scale_out: bool | None = None


class UpstreamFacts:
    """The facts cache of one upstream, asked through `fetch` within `timeout` seconds each."""

    def __init__(self, fetch: Fetch, reasoning_setting: str, timeout: float) -> None:
        self._fetch = fetch
        self._reasoning_setting = reasoning_setting
        self.timeout = timeout
        self.version: str | None = None
        self.version_problem = ""
        self._version_at = 0.0
        self.models: OrderedDict[str, ModelFacts] = OrderedDict()
        self._lock = asyncio.Lock()
        #: How many times a new connection's check found another process.
        self.restarts_seen = 0
        #: The engine's weight version as last read (``/weight_info``), and whether the route
        #: is served (None: not asked yet in this process).
        self.engine_weight_version: str | None = None
        self.engine_weights_served: bool | None = None
        self._weights_asked_at = -RETRY_SECONDS
        #: The ``/weight_info`` read in flight, and the next one its late callers share.
        self._reading: asyncio.Future[str | None] | None = None
        self._next_read: asyncio.Future[str | None] | None = None
        #: Whether the upstream serves vLLM's scale-out routes (render, generate, derender), as
        #: the last probe render said; None: not known in this process yet.
        self.scale_out: bool | None = None
        self._scale_out_asked_at = -RETRY_SECONDS
        #: How long a fact that could not be fetched is left unknown (`RETRY_SECONDS`).
        self.retry_seconds = RETRY_SECONDS

    def forget(self) -> None:
        """Ask for every fact again: the upstream was unreachable (maybe restarted)."""
        self.version = None
        self.models.clear()
        self.scale_out = None
        self._scale_out_asked_at = -RETRY_SECONDS - self.retry_seconds
        self._forget_weights()

    def _forget_weights(self) -> None:
        self.engine_weight_version = None
        self.engine_weights_served = None
        self._weights_asked_at = -RETRY_SECONDS - self.retry_seconds

    async def read_engine_weight_version(self) -> str | None:
        """The engine's weight version now (``GET /weight_info``, vLLM's dev-mode route), or None
        when the route is not served (asked once per upstream process) or fails.

        "Now" means a read sent after this method was called: a call's version is read for that
        call, never taken from before it. Callers that ask while a read is in flight share the
        next one (sent when it ends), so a burst of calls sends at most two reads at a time."""
        if self.engine_weights_served is False:
            return None
        loop = asyncio.get_running_loop()
        pending = self._next_read
        if pending is None or pending.done() or pending.get_loop() is not loop:
            # (A done one was cancelled before it began; another loop's is of no use here.)
            previous = self._reading
            if previous is not None and previous.get_loop() is not loop:
                previous = None
            pending = self._next_read = loop.create_task(self._read_after(previous))
        return await asyncio.shield(pending)

    async def _read_after(self, previous: asyncio.Future[str | None] | None) -> str | None:
        if previous is not None and not previous.done():
            await asyncio.wait([previous])
        # From here on, a new caller's read must start after this one: it gets the next.
        self._reading, self._next_read = self._next_read, None
        return await self._read_once()

    async def _read_once(self) -> str | None:
        self._weights_asked_at = time.monotonic()
        version: str | None = None
        try:
            status, raw = await self._fetch("GET", "/weight_info", None, self.timeout)
            if status == 200:
                got = orjson.loads(raw).get("weight_version")
                version = str(got) if got is not None and got != "" else None
            self.engine_weights_served = status != 404
        except (UpstreamFailed, orjson.JSONDecodeError, AttributeError) as e:
            log.warning("upstream /weight_info failed: %s: engine weight version unknown", e)
        self.engine_weight_version = version
        return version

    def _version_due(self, now: float) -> bool:
        if self.version is None:
            return True
        wait = self.retry_seconds if self.version_problem else REFRESH_SECONDS
        return now - self._version_at > wait

    def _weights_due(self, now: float) -> bool:
        served = self.engine_weights_served
        return served is None and now - self._weights_asked_at > self.retry_seconds

    def _model_due(self, model: str, now: float) -> bool:
        facts = self.models.get(model)
        if facts is None:
            return True
        wait = self.retry_seconds if facts.problem else REFRESH_SECONDS
        return now - facts.fetched_at > wait

    async def info(self, model: str) -> UpstreamInfo:
        """The facts for a call to `model`, fetching what is missing or due (one fetch at a time:
        the others wait for its answer)."""
        now = time.monotonic()
        if self._version_due(now) or self._model_due(model, now) or self._weights_due(now):
            async with self._lock:
                now = time.monotonic()
                want_version, want_model = self._version_due(now), self._model_due(model, now)
                if want_version or want_model or self._weights_due(now):
                    version, facts = await self._fetch_all(model, want_version, want_model)
                    if version is not None:
                        self._keep_version(version)
                    if facts is not None:
                        self._keep_model(model, facts)
        elif model in self.models:
            self.models.move_to_end(model)
        info = self._info(model)
        _PLANNED.set((model, info))
        return info

    def _info(self, model: str) -> UpstreamInfo:
        version = self.version or ""
        field = self._reasoning_setting
        if field == "auto":
            field = reasoning_field_for(version)
        facts = self.models.get(model)
        problems = tuple(p for p in (self.version_problem, facts.problem if facts else "") if p)
        return UpstreamInfo(
            version,
            field,
            facts.fingerprint if facts else "",
            facts.sampling_defaults if facts else None,
            problems,
            self.engine_weight_version,
            facts.scale_out if facts and facts.scale_out is not None else self.scale_out,
        )

    def _keep_version(self, version: tuple[str, str]) -> None:
        self.version, self.version_problem = version
        self._version_at = time.monotonic()

    def _keep_model(self, model: str, facts: ModelFacts) -> None:
        if facts.scale_out is not None:
            self.scale_out = facts.scale_out
        self.models[model] = facts
        self.models.move_to_end(model)
        while len(self.models) > MODELS_KEPT:
            self.models.popitem(last=False)

    def problems(self) -> list[str]:
        """The facts currently missing, one sentence each (for ``/readyz``)."""
        out = [self.version_problem] if self.version_problem else []
        out += [f"model {m!r}: {f.problem}" for m, f in self.models.items() if f.problem]
        return out

    # -- the check when a new connection opens ---------------------------------------------------

    async def verify(self) -> None:
        """Raise `UpstreamRestarted` when the upstream no longer has the facts the current call
        was planned with (called when a chat call opens a new connection, before it is sent).

        A fact that cannot be fetched now is not evidence of a new process: the call goes on and
        the fact is asked for again with the next call.
        """
        planned = _PLANNED.get()
        if planned is None:
            return  # a post without `info` first: nothing was planned from facts
        model, info = planned
        if not info.version and not info.fingerprint:
            return  # planned without facts (they failed): nothing to compare, nor to wait for
        version, facts = await self._fetch_all(model, True, True)
        changed = []
        if version is not None and not version[1] and version[0] != info.version:
            changed.append(f"version {info.version or '?'} → {version[0]}")
        if facts is not None and not facts.problem:
            if facts.fingerprint != info.fingerprint:
                changed.append("tokenizer fingerprint")
            if facts.sampling_defaults != info.sampling_defaults:
                changed.append("sampling defaults")
            if facts.scale_out is not None and facts.scale_out != info.scale_out:
                changed.append("scale-out routes")
        # Read after the fetch: a check that ran beside this one (a token-in call opens several
        # connections at once) may have noticed the new process already.
        noticed = _facts_of(self._info(model)) != _facts_of(info)
        if version is not None and not version[1]:
            self._keep_version(version)
        if facts is not None and not facts.problem:
            self._keep_model(model, facts)
        if changed:
            if not noticed:
                self.restarts_seen += 1
                self._forget_weights()  # they were the old process's
                log.warning("the upstream is a new process (%s): planning the call again", changed)
            raise UpstreamRestarted(f"the upstream changed under the call ({', '.join(changed)})")

    # -- fetching ------------------------------------------------------------------------------

    async def _fetch_all(
        self, model: str, want_version: bool, want_model: bool
    ) -> tuple[tuple[str, str] | None, ModelFacts | None]:
        """The facts asked for, in parallel (one round trip, bounded by the fact timeout)."""
        jobs: list[Awaitable[Any]] = []
        if want_version:
            jobs.append(self._fetch_version())
        if want_model:
            jobs += [self._fetch_fingerprint(model), self._fetch_defaults(model)]
        if self._weights_due(time.monotonic()):
            # Whether /weight_info is served, asked once per process beside the other facts
            # (its answer is kept by read_engine_weight_version itself).
            jobs.append(self._read_weights_quietly())
        got = await asyncio.gather(*jobs)
        version: tuple[str, str] | None = got[0] if want_version else None
        facts = None
        if want_model:
            (fingerprint, problem), (defaults, scale_out) = got[1:3] if want_version else got[0:2]
            facts = ModelFacts(fingerprint, defaults, problem, time.monotonic(), scale_out)
        return version, facts

    async def _read_weights_quietly(self) -> None:
        await self.read_engine_weight_version()

    async def _fetch_version(self) -> tuple[str, str]:
        """``(version, problem)``: the version, or "" and why it is unknown."""
        try:
            status, raw = await self._fetch("GET", "/version", None, self.timeout)
            if status == 200:
                version = orjson.loads(raw).get("version", "")
                if isinstance(version, str) and version:
                    return version, ""
                problem = "upstream /version answered no version"
            else:
                problem = f"upstream /version answered {status}"
        except (UpstreamFailed, orjson.JSONDecodeError, AttributeError) as e:
            problem = f"upstream /version failed: {e}"
        log.warning("%s: version unknown, asking again in %gs", problem, self.retry_seconds)
        return "", problem

    async def _fetch_fingerprint(self, model: str) -> tuple[str, str]:
        """``(fingerprint, problem)``."""
        body = {"model": model, "messages": PROBE_MESSAGES, "add_generation_prompt": True}
        try:
            status, raw = await self._fetch("POST", "/tokenize", orjson.dumps(body), self.timeout)
            if status == 200:
                fingerprint = fingerprint_of(orjson.loads(raw)["tokens"])
                if fingerprint:
                    return fingerprint, ""
                problem = "upstream /tokenize answered no token ids"
            else:
                problem = f"upstream /tokenize answered {status}"
        except (UpstreamFailed, orjson.JSONDecodeError, KeyError, TypeError) as e:
            problem = f"upstream /tokenize failed: {e}"
        problem += ": no tokenizer fingerprint"
        log.warning("%s (model %r), asking again in %gs", problem, model, self.retry_seconds)
        return "", problem

    async def _fetch_defaults(
        self, model: str | None
    ) -> tuple[Mapping[str, Any] | None, bool | None]:
        """``(sampling defaults, scale-out served)`` from a probe render: the defaults are None
        when the route is not served or fails; the routes are served when it answers 200, not
        served when it answers 403 (vLLM without ``--enable-scale-out``) or a route-level 404
        (a vLLM without them), and unknown (None) on any other answer or failure."""
        body: dict[str, Any] = {"messages": PROBE_MESSAGES}
        if model is not None:
            body["model"] = model
        try:
            status, raw = await self._fetch(
                "POST", "/v1/chat/completions/render", orjson.dumps(body), self.timeout
            )
            if status == 200:
                return sampling_defaults_of(orjson.loads(raw)), True
            served = scale_out_served(status, raw)
            if served is None:
                log.warning("upstream render answered %d: effective sampling unknown", status)
            return None, served
        except (UpstreamFailed, orjson.JSONDecodeError) as e:
            log.warning("upstream render failed: %s: effective sampling unknown", e)
        return None, None

    async def check_scale_out(self) -> bool | None:
        """Whether the upstream serves the scale-out routes: True once known; otherwise one
        probe render (for the served model) at most once per `retry_seconds`, so an upstream
        restarted with ``--enable-scale-out`` is noticed even while no call reaches it. Routes
        that appear mean a new process: every fact is asked for again."""
        now = time.monotonic()
        if self.scale_out is not True and now - self._scale_out_asked_at > self.retry_seconds:
            self._scale_out_asked_at = now
            _, served = await self._fetch_defaults(None)
            if served and self.scale_out is False:
                log.warning("the upstream now serves the scale-out routes: a new process")
                self.forget()
            if served is not None:
                self.scale_out = served
        return self.scale_out


def _facts_of(info: UpstreamInfo) -> tuple[Any, ...]:
    """The facts a restart check compares."""
    return (info.version, info.fingerprint, info.sampling_defaults, info.scale_out)
