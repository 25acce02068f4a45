"""The upstream idle timeout on streams: silence longer than it fails the stream, a slow but
steady stream longer than it in total does not (one timer per stream, re-armed per read)."""

from __future__ import annotations

import time
from typing import Any

from capture_proxy.schemas.records import CallStatus
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn
from tests.support.proxy_harness import chat_body, sse_lines, user


async def _lines(resp: Any) -> list[bytes]:
    return [line async for line in sse_lines(resp) if line]


async def test_steady_stream_longer_than_the_idle_timeout_is_staged(make_proxy: Any) -> None:
    fake = FakeVLLM(chunk_delay=0.05)
    fake.push(Turn("one two three four five six seven eight nine ten"))
    p = await make_proxy(fake=fake, upstream_idle_timeout=0.3)
    started = time.monotonic()
    resp = await p.chat(chat_body(user("x"), stream=True))
    lines = await _lines(resp)
    assert time.monotonic() - started > 0.6  # twice the idle timeout, in small gaps
    assert lines[-1] == b"data: [DONE]"
    assert lines[-2].startswith(b": capture-status staged")
    assert len(p.calls()) == 1


async def test_silence_after_some_chunks_fails_the_stream(make_proxy: Any) -> None:
    # The chunk gap is far beyond the idle timeout so that a loaded machine's scheduling delay
    # cannot blur which of the two ended the stream.
    fake = FakeVLLM(chunk_delay=3.0)
    p = await make_proxy(fake=fake, upstream_idle_timeout=0.25)
    started = time.monotonic()
    resp = await p.chat(chat_body(user("x"), stream=True))
    lines = await _lines(resp)
    assert b"data: [DONE]" not in lines
    assert b"upstream_idle_timeout" in lines[-1]
    assert time.monotonic() - started < 2.5  # failed at the idle timeout, not at the chunk
    [failure] = p.failures()
    assert failure.status is CallStatus.UPSTREAM_ERROR
    assert failure.reason == "upstream_idle_timeout"
