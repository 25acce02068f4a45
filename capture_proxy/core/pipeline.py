"""What every call of a proxy (or a `CaptureClient`) shares: `Pipeline` (the capture core, the
upstream, the adapters and caches, the background tasks), its settings (`ExchangeConfig`), and
how a call ended (`Outcome`). One call's flow is `capture_proxy.core.exchange.Exchange`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..adapters.vllm import ReasoningField, VLLMAdapter
from ..schemas.records import CallStatus, StageResult
from ..schemas.request import DEFAULT_MAX_JSON_ITEMS, FreeJsonLimits
from .capture import Capture
from .decode_budget import DecodeBudget
from .pins import pin, write_pin
from .rollouts import RolloutLive
from .sampling import changes_distribution
from .token_in import CloseRenders, PromptJson, TokenInReport, goes_token_in
from .transport import ReplicaRouter, UpstreamTransport

if TYPE_CHECKING:
    from .exchange import Exchange

__all__ = ["ExchangeConfig", "Outcome", "Pipeline"]

#: The exchange's logger: what the pipeline warns of is about the calls it runs.
log = logging.getLogger("capture_proxy.exchange")


@dataclass(frozen=True, slots=True)
class ExchangeConfig:
    """The settings one call's flow depends on (the proxy fills it from its `Settings`)."""

    #: Accept ``http(s)`` image URLs (forwarded as they are) instead of only ``data:`` URLs.
    allow_remote_media: bool = False
    #: With a context window: refuse (or cap) a call whose prompt + max_tokens cannot fit.
    max_model_len: int = 0
    context_overflow: Literal["refuse", "cap"] = "refuse"
    #: Bounds on free-form JSON values (``--max-free-json-bytes``, ``--max-free-json-items``).
    free_json: FreeJsonLimits = field(default_factory=FreeJsonLimits)
    #: Commas, brackets and braces a whole body may hold (``--max-json-items``).
    max_json_items: int = DEFAULT_MAX_JSON_ITEMS
    #: Bytes of large bodies decoded at once (``--max-decoding-bytes``; 0: unbounded).
    max_decoding_bytes: int = 0
    #: The upstream's logprobs mode as declared (``--upstream-logprobs-mode``), stamped on every
    #: record: ``raw_logprobs``, ``processed_logprobs`` or ``unknown``.
    logprobs_mode: str = "unknown"
    #: The proxy's ``--token-in`` setting (``off`` / ``on``): whether a rollout that made no
    #: choice of its own goes token-in (`Pipeline.goes_token_in`).
    token_in: str = "off"
    #: A token-in call sends upstream at most about this many times the plain call's bytes
    #: (``--token-in-upstream-bound``): what bounds a stream's derender calls.
    token_in_upstream_bound: float = 3.0
    #: A bridged call whose close and anchors are known sends generate beside the request's own
    #: render, which then checks it (``--token-in-beside``; docs/token-in.md).
    token_in_beside: bool = False


@dataclass(slots=True)
class Outcome:
    """How a call ended. `body` is what a client gets for a unary call: the answer (token fields
    it did not ask for removed) or the upstream's relayed error body."""

    status: CallStatus
    call_id: str
    http_status: int = 200
    body: bytes = b""
    reason: str = ""
    message: str = ""
    result: StageResult | None = None


class Pipeline:
    """What every exchange shares: the capture core, the upstream, the adapters, the settings.

    `spawn` runs a coroutine to completion even if the request that started it is cancelled
    (staging, and the ledger entry of an aborted call); the proxy passes its own, which it
    drains at shutdown.
    """

    def __init__(
        self,
        capture: Capture,
        upstream: UpstreamTransport,
        config: ExchangeConfig | None = None,
    ) -> None:
        self.capture = capture
        self.upstream = upstream
        #: Several replicas behind `upstream` (each rollout pinned to one), or None: one.
        self.replicas = upstream if isinstance(upstream, ReplicaRouter) else None
        self.config = config or ExchangeConfig()
        self._adapters: dict[str, VLLMAdapter] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Warnings about what the records say, by kind, each logged once (``/readyz`` shows them).
        self.warnings: dict[str, str] = {}
        #: Subscribers told of every token-in call (`report_token_in`): the proxy's metrics.
        self.on_token_in: list[Callable[[TokenInReport], None]] = []
        #: The token-in bridge's turn-close renders, shared by every rollout (`CloseRenders`).
        self.close_renders = CloseRenders()
        #: The JSON of staged token-in calls' prompt ids, for the calls that extend them.
        self.prompt_json = PromptJson()
        #: Large bodies take turns to be decoded (`DecodeBudget`).
        self.decode_budget = DecodeBudget(self.config.max_decoding_bytes)

    def exchange(self, rollout_id: str) -> Exchange:
        """A new call of `rollout_id` through this pipeline."""
        from .exchange import Exchange  # the exchange's module builds on this one

        return Exchange(self, rollout_id)

    def goes_token_in(self, live: RolloutLive) -> bool:
        """Whether the rollout's calls go token-in: its own choice, else ``--token-in``."""
        return goes_token_in(live.token_in, self.config.token_in)

    def report_token_in(self, report: TokenInReport) -> None:
        """Tell the subscribers what token-in did for one call (once per token-in call)."""
        for subscriber in self.on_token_in:
            subscriber(report)

    def route(self, live: RolloutLive) -> tuple[str, UpstreamTransport]:
        """The replica a call of `live` goes to (see `ReplicaRouter.route`): its pin, or a new
        one, written to the rollout's event log. Raises `UpstreamFailed` (503) when none can be
        used. With a single upstream: ``("", upstream)``."""
        replicas = self.replicas
        if replicas is None or live.sealed:
            return "", self.upstream  # a sealed rollout's call is refused at admission: no pin
        name, transport = replicas.route(live.rollout_id, live.replica, self.replica_load)
        if name != live.replica:
            self.spawn(write_pin(self.capture.sink, pin(live, name)))
        return name, transport

    def replica_load(self) -> dict[str, int]:
        """Live rollouts per replica: the load a new rollout is placed by."""
        load: dict[str, int] = {}
        for live in self.capture.rollouts.values():
            if live.replica:
                load[live.replica] = load.get(live.replica, 0) + 1
        return load

    def adapter(self, reasoning_field: str) -> VLLMAdapter:
        adapter = self._adapters.get(reasoning_field)
        if adapter is None:
            rf: ReasoningField = (
                "reasoning" if reasoning_field == "reasoning" else "reasoning_content"
            )
            adapter = self._adapters[reasoning_field] = VLLMAdapter(reasoning_field=rf)
        return adapter

    def use_adapter(self, adapter: VLLMAdapter) -> None:
        """Use `adapter` for its reasoning field (instead of a default one)."""
        self._adapters[adapter.reasoning_field] = adapter

    def forget_rollouts(self, rollout_ids: list[str]) -> None:
        """Drop per-rollout caches of rollouts that left memory (sealed or idle)."""
        for adapter in self._adapters.values():
            for rollout_id in rollout_ids:
                adapter.prefixes.drop(rollout_id)

    def check_logprobs_mode(self, effective: Mapping[str, Any]) -> None:
        """Warn (once) when the upstream's logprobs are raw, or may be, while a call's effective
        sampling changes the distribution: its logprobs are then not those of the
        distribution its tokens were sampled from."""
        mode = self.config.logprobs_mode
        if mode == "processed_logprobs" or "logprobs_mode" in self.warnings:
            return
        changed = changes_distribution(effective)
        if changed:
            self.warnings["logprobs_mode"] = (
                f"the upstream's logprobs mode is {mode} while the effective sampling "
                f"changes the distribution ({', '.join(changed)}, the model's own defaults "
                "included): the recorded logprobs are not those of the distribution sampled "
                "from; start vLLM with --logprobs-mode processed_logprobs and declare it with "
                "--upstream-logprobs-mode"
            )
            log.warning("%s", self.warnings["logprobs_mode"])

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` to completion even if the request that started it is cancelled."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait_background(self, wait_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=wait_s)
