"""The lifecycle of the application's resources, through aiohttp's cleanup context: at start
the upstream client (one, several replicas, or the bundled fake vLLM), the pipeline, the ledger
journal replayed and its disk space reserved, the weight version, the guards; at exit the
calls drained, the sink closed, and the ledger entries it never took spilled to the journal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

from aiohttp import web

from ..core.journal import journal_path, release_reserve, replay_journal, reserve_journal
from ..core.pipeline import ExchangeConfig, Pipeline
from ..core.shared_reader import SharedReader
from ..schemas.request import FreeJsonLimits
from ..upstream.http import HTTPUpstream
from ..upstream.replicas import ReplicaSet
from .guards import follow_weight_version, run_guards
from .loop_lag import LoopLag
from .state import STATE, ProxyState

log = logging.getLogger("capture_proxy")


async def mark_shutting_down(app: web.Application) -> None:
    """On shutdown, before the cleanup: calls its deadline cuts off are recorded as `shutdown`."""
    app[STATE].shutting_down = True


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


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
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
            token_in_beside=s.token_in_beside == "on",
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
    guards = asyncio.create_task(run_guards(state, s.store))
    follow = asyncio.create_task(follow_weight_version(state))
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
