"""A call whose rollout must be read back from the store waits at most
``--rollout-resume-timeout`` seconds: then 503 ``rollout_resume_timeout`` with Retry-After, a log
line and a count, the read going on so the retry is served; a read that fails is a 503
``rollout_resume_failed`` naming why, never a 500. Nothing is lost: no seq was taken, and the
retried call is staged at the next one.

The store's reads are made slow (or failing) by wrapping the real reader's opener the proxy
resumes rollouts with: the store, its files and the reads themselves are the real ones."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from capture_proxy.sinks.base import StagingSource
from tests.support.proxy_harness import Proxy, chat_body, user

BOUND_S = 0.3


def _released(p: Proxy) -> None:
    """The rollout leaves the proxy's memory (as an idle one does): its next call reads it."""
    assert p.state.capture.evict_idle(0) == ["ep"]


def _slow(opener: Callable[[], StagingSource], seconds: float) -> Callable[[], StagingSource]:
    def open_slowly() -> StagingSource:
        time.sleep(seconds)  # a worker thread: the store is slow, the proxy is not
        return opener()

    return open_slowly


async def test_a_slow_resume_is_a_503_naming_it_logged_counted_and_the_retry_is_staged(
    make_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p = await make_proxy(rollout_resume_timeout=BOUND_S)
    for text in ("a", "b"):
        assert (await p.chat(chat_body(user(text)), rollout="ep")).status == 200
    _released(p)
    resumes = p.state.capture.resumes
    assert resumes is not None
    resumes.source = _slow(resumes.source, 1.0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="capture_proxy.capture"):
        refused = await p.chat(chat_body(user("c")), rollout="ep")
    assert time.monotonic() - started < 1.0  # answered at the bound, not when the read ended
    assert refused.status == 503
    assert refused.headers["Retry-After"] == "5"
    error = (await refused.json())["error"]
    assert error["code"] == "rollout_resume_timeout"
    assert "--rollout-resume-timeout" in error["message"]
    assert any(
        "rollout ep: reading it from the store took over 0.3s" in r.getMessage()
        for r in caplog.records
    )
    metrics = await (await p.client.get("/metrics")).text()
    assert "capture_proxy_rollout_resume_timeouts_total 1.0" in metrics
    assert (
        'capture_proxy_calls_total{outcome="rejected",reason="rollout_resume_timeout"} 1.0'
        in metrics
    )
    # The read went on and the rollout is held once it ends: the retry is served at once.
    await asyncio.sleep(1.2)
    retried = await p.chat(chat_body(user("c")), rollout="ep")
    assert retried.headers["X-Capture-Status"] == "staged"
    assert [r.seq for r in p.calls("ep")] == [0, 1, 2]
    assert p.failures("ep") == []  # the refused call took no seq


async def test_a_resume_that_fails_is_a_503_naming_why_not_a_500(
    make_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p = await make_proxy(rollout_resume_timeout=5)
    assert (await p.chat(chat_body(user("a")), rollout="ep")).status == 200
    _released(p)
    resumes = p.state.capture.resumes
    assert resumes is not None
    real = resumes.source

    def unreachable() -> StagingSource:
        raise OSError("the store is unreachable")

    resumes.source = unreachable
    with caplog.at_level(logging.ERROR, logger="capture_proxy.capture"):
        refused = await p.chat(chat_body(user("b")), rollout="ep")
    assert refused.status == 503
    error = (await refused.json())["error"]
    assert error["code"] == "rollout_resume_failed"
    assert "OSError: the store is unreachable" in error["message"]
    assert any("reading it from the store failed" in r.getMessage() for r in caplog.records)
    metrics = await (await p.client.get("/metrics")).text()
    assert "capture_proxy_rollout_resume_failures_total 1.0" in metrics
    resumes.source = real
    assert (await p.chat(chat_body(user("b")), rollout="ep")).status == 200
    assert [r.seq for r in p.calls("ep")] == [0, 1]
