"""The upstream as the capture core sees it: a small interface, no HTTP library.

`Exchange` talks to vLLM only through an `UpstreamTransport` (httpx's one-method transport is the
model). `capture_proxy.upstream.HTTPUpstream` is the aiohttp implementation the proxy and the
library use; a test or a framework with its own client can provide another.

Every failure to reach the upstream or read its answer is raised as
`capture_proxy.errors.UpstreamFailed` (with a ``code`` such as ``upstream_timeout``), never as
the HTTP library's own exception: the flow maps one kind of error to one ledger entry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, cast, runtime_checkable

from ..errors import UpstreamFailed

__all__ = [
    "SCALE_OUT_DISABLED",
    "EngineRoute",
    "EngineWeights",
    "ReplicaRouter",
    "ScaleOutCheck",
    "TokenInTransport",
    "UpstreamInfo",
    "UpstreamReply",
    "UpstreamRestarted",
    "UpstreamTransport",
    "token_in_transport",
]


@dataclass(frozen=True, slots=True)
class UpstreamInfo:
    """Facts about the upstream that every record carries (fetched lazily, refreshed for each
    new upstream process)."""

    #: vLLM's version (``GET /version``), "" when unknown.
    version: str
    #: The field replayed reasoning is sent in: ``reasoning_content`` or ``reasoning``.
    reasoning_field: str
    #: ``sha256:<hex>`` of the ids the upstream's /tokenize gives a fixed probe; "" when unknown.
    fingerprint: str
    #: The sampling parameters the upstream fills in for a request that sets none of them (the
    #: model's generation-config defaults, read from a probe render); None when unknown (the
    #: render route is not served): then no effective sampling is recorded.
    sampling_defaults: Mapping[str, Any] | None = None
    #: Why a fact is missing (``/version`` or ``/tokenize`` failing), one sentence each; a record
    #: staged with a missing fact carries these in its extras (``upstream_fact_problems``).
    problems: tuple[str, ...] = ()
    #: The engine's own weight version (vLLM's ``/weight_info``) as last read (by any call);
    #: None when the upstream does not serve it. A call reads its own (`EngineWeights`).
    engine_weight_version: str | None = None
    #: Whether the upstream serves vLLM's scale-out routes (render, generate, derender: what
    #: token-in calls), from the probe render; None when not known.
    scale_out: bool | None = None


class UpstreamRestarted(UpstreamFailed):
    """The upstream is a new process whose facts differ from those the call was planned with.

    Raised by `UpstreamTransport.post_chat` *before* the request is sent (the check runs when a
    new connection opens, the only way a new process can be reached), so the caller can plan the
    call again with fresh `UpstreamTransport.info` and send it once more. A transport that cannot
    tell never raises it.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, code="upstream_restarted", status=502)


class UpstreamReply(Protocol):
    """The upstream's answer to one chat request, once its status line is in.

    Use it as an async context manager (the connection is released on exit). `read` returns
    the whole body; `chunks` yields the body as it arrives. Both raise `UpstreamFailed` when the
    answer breaks off or stalls longer than the transport's idle timeout.
    """

    @property
    def status(self) -> int: ...

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def close(self) -> None: ...

    async def __aenter__(self) -> UpstreamReply: ...

    async def __aexit__(self, *exc: object) -> None: ...


class UpstreamTransport(Protocol):
    """What the capture flow needs from an upstream vLLM."""

    async def info(self, model: str) -> UpstreamInfo:
        """Version, reasoning field and tokenizer fingerprint for `model` (cached)."""
        ...

    async def count_prompt_tokens(self, request: Mapping[str, Any]) -> int:
        """The prompt's length in tokens as the upstream renders it (the context guard)."""
        ...

    async def post_chat(self, body: bytes) -> UpstreamReply:
        """POST `body` to the chat route; the reply once its headers are in."""
        ...


class EngineRoute(StrEnum):
    """vLLM's token-in routes (served with ``vllm serve --enable-scale-out``), by path."""

    #: A Chat Completions body in, a ``GenerateRequest`` out (the prompt ids, sampling params).
    RENDER = "/v1/chat/completions/render"
    #: Token ids in, completion ids, logprobs and weight spans out; ``stream: true`` streams.
    GENERATE = "/inference/v1/generate"
    #: A generate answer (or one streamed chunk with its state) in, a Chat Completions answer out.
    DERENDER = "/v1/chat/completions/derender"


def token_in_transport(upstream: UpstreamTransport) -> TokenInTransport | None:
    """`upstream` when it is a `TokenInTransport` (it has `TokenInTransport.post_engine`), else
    None. What ``isinstance(upstream, TokenInTransport)`` says of an `UpstreamTransport`, looking
    up the one member it adds rather than every member of both protocols (about 12 µs a call,
    paid on every token-in call's path)."""
    if callable(getattr(upstream, "post_engine", None)):
        return cast(TokenInTransport, upstream)
    return None


#: The message of `UpstreamFailed` (code ``scale_out_disabled``, status 503) when the upstream
#: refuses a token-in route because it was started without ``--enable-scale-out``.
SCALE_OUT_DISABLED = (
    "the upstream does not serve vLLM's token-in routes (render, generate, derender): start "
    "vllm serve with --enable-scale-out"
)


@runtime_checkable
class TokenInTransport(UpstreamTransport, Protocol):
    """An upstream that can also be asked on vLLM's token-in routes (optional for a transport)."""

    async def post_engine(self, route: EngineRoute, body: bytes) -> UpstreamReply:
        """POST `body` (JSON) to `route`; the reply once its headers are in.

        Timeouts, connection handling and `UpstreamRestarted` are those of `post_chat`. The
        upstream's 403 "Scale-out endpoints are disabled" raises `UpstreamFailed` with code
        ``scale_out_disabled`` (status 503, message `SCALE_OUT_DISABLED`); any other status comes
        back in the reply, for the caller to relay.
        """
        ...


@runtime_checkable
class EngineWeights(Protocol):
    """An upstream that can say which weights its engine holds (optional for a transport)."""

    async def read_engine_weight_version(self) -> str | None:
        """The engine's weight version now (one request), or None when it does not say."""
        ...


@runtime_checkable
class ScaleOutCheck(Protocol):
    """An upstream that can check again whether it serves vLLM's scale-out routes (optional)."""

    async def scale_out_served(self) -> bool | None:
        """Whether the routes are served now (asked again while they are not), None: unknown."""
        ...


@runtime_checkable
class ReplicaRouter(Protocol):
    """An upstream made of several replicas of one model, each rollout pinned to one (optional
    for a transport; `capture_proxy.upstream.ReplicaSet` is the proxy's).

    `Pipeline` routes each call through `route` before admitting it; a transport that is not a
    router is used as it is, for every rollout.
    """

    def route(
        self, rollout_id: str, pinned: str, load: Callable[[], Mapping[str, int]]
    ) -> tuple[str, UpstreamTransport]:
        """The replica (its name and transport) a call of `rollout_id` goes to.

        `pinned` is the replica the rollout is pinned to ("" for none yet): it is kept while
        healthy. A rollout without one, or (when the router moves rollouts) whose replica is
        unhealthy, gets the least loaded healthy replica, `load()` giving the rollouts per
        replica; ties go by a hash of the rollout id. Raises `UpstreamFailed` (503
        ``upstream_unavailable``) when there is none to use. Synchronous: no I/O per call.
        """
        ...

    def check_weights(self, name: str, engine_version: str | None) -> None:
        """A call's read of replica `name`'s engine weight version (None: not known), before the
        call is admitted: raises `UpstreamFailed` (503 ``upstream_unavailable``) when the
        engine holds other weights than the fleet's, so no call is sampled by them."""
        ...
