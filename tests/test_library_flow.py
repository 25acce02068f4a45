"""CaptureClient runs the proxy's whole call flow in-process: validation, the context guard, the
upstream round trip (unary and streamed), staging, and the ledger for every way a call ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from capture_proxy.errors import BadRequest, ProxyError, UpstreamFailed
from capture_proxy.library import CaptureClient
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.testing.fake_vllm import FakeVLLM, Fault, Turn
from tests.support.proxy_harness import chat_body, user


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM(max_model_len=4096)
    server = TestServer(fake.app())
    await server.start_server()
    try:
        yield fake, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def _client(tmp_path: Path, base: str, **options: object) -> CaptureClient:
    return CaptureClient(open_sink(f"sqlite:///{tmp_path / 'lib.db'}"), upstream=base, **options)  # type: ignore[arg-type]


def _stored(tmp_path: Path, rollout: str) -> tuple[list[int], list[tuple[str, str]]]:
    source = open_source(f"sqlite:///{tmp_path / 'lib.db'}")
    try:
        seqs = [r.seq for r in source.calls(rollout)]
        failures = [(str(f.status), f.reason) for f in source.failures(rollout)]
    finally:
        source.close_reader()
    return seqs, failures


async def test_chat_stages_a_unary_and_a_streamed_call(
    tmp_path: Path, fake: tuple[FakeVLLM, str]
) -> None:
    upstream, base = fake
    upstream.push(Turn("hello"), Turn("again"))
    client = _client(tmp_path, base)
    try:
        unary = await client.chat("ep", chat_body(user("hi")))
        assert unary.status is CallStatus.STAGED
        assert unary.result is not None
        assert unary.result.coords is not None
        assert b'"hello"' in unary.body
        assert b"prompt_token_ids" not in unary.body  # the client did not ask for them

        streamed = await client.chat("ep", chat_body(user("hi"), stream=True))
        assert streamed.status is CallStatus.STAGED
        assert streamed.body.startswith(b"data: ")
        assert b"token_ids" not in streamed.body
    finally:
        await client.close()
    assert _stored(tmp_path, "ep") == ([0, 1], [])


async def test_stream_yields_the_bytes_as_they_arrive(
    tmp_path: Path, fake: tuple[FakeVLLM, str]
) -> None:
    upstream, base = fake
    upstream.chunk_delay = 0.02  # events apart in time, so reads cannot coalesce them
    upstream.push(Turn("one two three"))
    client = _client(tmp_path, base)
    try:
        streamed = await client.stream("ep", chat_body(user("hi"), stream=True))
        pieces = [piece async for piece in streamed]
        assert len(pieces) > 1
        assert streamed.result is not None
        assert streamed.result.status is CallStatus.STAGED
    finally:
        await client.close()


async def test_an_upstream_error_is_relayed_and_ledgered(
    tmp_path: Path, fake: tuple[FakeVLLM, str]
) -> None:
    upstream, base = fake
    upstream.push(Turn("x", fault=Fault.http_error(503)))
    client = _client(tmp_path, base)
    try:
        result = await client.chat("ep", chat_body(user("hi")))
    finally:
        await client.close()
    assert result.status is CallStatus.UPSTREAM_ERROR
    assert result.http_status == 503
    assert b'"error"' in result.body
    assert _stored(tmp_path, "ep") == ([], [("upstream_error", "upstream_503")])


async def test_an_unreachable_upstream_raises_and_is_ledgered(tmp_path: Path) -> None:
    client = _client(tmp_path, "http://127.0.0.1:9", connect_timeout=1)  # discard port: closed
    try:
        with pytest.raises(UpstreamFailed) as e:
            await client.chat("ep", chat_body(user("hi")))
    finally:
        await client.close()
    assert e.value.code == "upstream_unreachable"
    assert e.value.__cause__ is not None  # the aiohttp error is kept as the cause
    assert _stored(tmp_path, "ep") == ([], [("upstream_error", "upstream_unreachable")])


async def test_the_context_guard_runs_in_the_library(
    tmp_path: Path, fake: tuple[FakeVLLM, str]
) -> None:
    upstream, base = fake
    client = _client(tmp_path, base, max_model_len=64)
    try:
        with pytest.raises(BadRequest) as e:
            await client.chat("ep", chat_body(user("word " * 200)))
    finally:
        await client.close()
    assert e.value.code == "context_overflow"
    assert upstream.requests == []  # refused before anything was forwarded
    assert _stored(tmp_path, "ep") == ([], [("rejected", "context_overflow")])


async def test_a_refused_request_names_the_path_and_keeps_its_cause(
    tmp_path: Path, fake: tuple[FakeVLLM, str]
) -> None:
    _, base = fake
    client = _client(tmp_path, base)
    try:
        with pytest.raises(ProxyError) as e:
            await client.chat("ep", chat_body({"role": "user", "content": "x", "bogus": 1}))
    finally:
        await client.close()
    assert e.value.status == 422
    assert e.value.param == "messages[0].bogus"
    assert _stored(tmp_path, "ep") == ([], [("rejected", "unknown_field")])


async def test_chat_without_an_upstream_says_how_to_give_one(tmp_path: Path) -> None:
    client = CaptureClient(open_sink(f"sqlite:///{tmp_path / 'lib.db'}"))
    try:
        with pytest.raises(UpstreamFailed, match=r"upstream=URL"):
            await client.chat("ep", chat_body(user("hi")))
    finally:
        await client.close()
    assert _stored(tmp_path, "ep") == ([], [("upstream_error", "no_upstream")])


async def test_a_new_client_on_the_same_store_continues_the_rollout(
    tmp_path: Path, fake: tuple[FakeVLLM, str]
) -> None:
    _, base = fake
    for _ in range(2):  # two processes' worth of clients, one after the other
        client = _client(tmp_path, base)
        try:
            result = await client.chat("ep", chat_body(user("hi")))
            assert result.status is CallStatus.STAGED
        finally:
            await client.close()
    assert _stored(tmp_path, "ep") == ([0, 1], [])


async def test_a_caller_that_stops_reading_a_stream_is_recorded_aborted(
    tmp_path: Path, fake: tuple[FakeVLLM, str]
) -> None:
    upstream, base = fake
    upstream.chunk_delay = 0.02
    upstream.push(Turn("one two three four five six"))
    client = _client(tmp_path, base)
    try:
        streamed = await client.stream("ep", chat_body(user("hi"), stream=True))
        pieces = aiter(streamed)
        assert await anext(pieces)  # the first bytes arrived, then the caller walks away
        await pieces.aclose()  # type: ignore[attr-defined]
        assert streamed.result is None  # the call never got a whole answer
    finally:
        await client.close()
    assert _stored(tmp_path, "ep") == ([], [("aborted", "client_disconnected")])


async def test_token_in_calls_continue_the_previous_call_exactly(tmp_path: Path) -> None:
    upstream = FakeVLLM(scale_out=True, drop_past_reasoning=True)
    upstream.push(Turn("First.", reasoning="Think."), Turn("Second."))
    server = TestServer(upstream.app())
    await server.start_server()
    client = _client(tmp_path, str(server.make_url("")).rstrip("/"), token_in=True)
    try:
        first = await client.chat("ep", chat_body(user("One.")))
        assert first.status is CallStatus.STAGED
        replayed = {"role": "assistant", "content": "First.", "reasoning": "Think."}
        second = await client.chat("ep", chat_body(user("One."), replayed, user("Two.")))
        assert second.status is CallStatus.STAGED
    finally:
        await client.close()
        await server.close()
    source = open_source(f"sqlite:///{tmp_path / 'lib.db'}")
    try:
        before, after = source.calls("ep")
    finally:
        source.close_reader()
    assert before.token_in
    assert after.token_in
    sent = [*before.prompt_token_ids, *before.completion_token_ids]
    assert list(after.prompt_token_ids[: len(sent)]) == sent
