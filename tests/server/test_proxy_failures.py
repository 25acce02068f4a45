"""Every way a call can fail, as the client sees it, and what the rollout's ledger then says."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.testing.fake_vllm import FakeVLLM, Fault, Turn
from tests.support.proxy_harness import chat_body, sse_lines, user

JSON_CT = {"Content-Type": "application/json"}


async def _events(resp: aiohttp.ClientResponse) -> list[bytes]:
    return [line async for line in sse_lines(resp) if line]


def _only_failure(p: Any, status: CallStatus, reason: str | None = None) -> Any:
    (entry,) = p.failures()
    assert entry.status is status
    if reason is not None:
        assert entry.reason == reason, entry
    assert p.calls() == []
    return entry


# -- refused before forwarding --------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (
            chat_body(user("a"), {"role": "assistant", "content": "b", "thinking_trace": "t"}),
            "messages[1].thinking_trace",
            "unknown_field",
        ),
        (
            chat_body(
                user("a"),
                {"role": "assistant", "content": "b", "reasoning": "x", "reasoning_content": "y"},
            ),
            "messages[1].reasoning",
            "reasoning_conflict",
        ),
        (chat_body(user("a"), include_reasoning=False), "include_reasoning", "capture_disabled"),
        (chat_body(user("a"), n=2), "n", None),
        (
            chat_body(
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}
                    ],
                }
            ),
            "messages[0].content[0].image_url.url",
            "remote_media_refused",
        ),
    ],
)
async def test_invalid_request_is_422_recorded_and_not_forwarded(
    make_proxy: Any, body: dict[str, Any], param: str, code: str | None
) -> None:
    p = await make_proxy()
    resp = await p.chat(body)
    assert resp.status == 422
    err = (await resp.json())["error"]
    assert err["param"] == param
    assert param in err["message"]
    if code:
        assert err["code"] == code
    assert resp.headers["X-Capture-Status"] == "rejected"
    assert p.fake.requests == []
    entry = _only_failure(p, CallStatus.REJECTED)
    assert entry.http_status == 422
    assert entry.call_id == resp.headers["X-Capture-Call-Id"]


async def test_invalid_json_is_400(make_proxy: Any) -> None:
    p = await make_proxy()
    resp = await p.client.post("/r/r1/v1/chat/completions", data=b"{not json", headers=JSON_CT)
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_json"
    _only_failure(p, CallStatus.REJECTED, "invalid_json")


async def test_body_over_limit_refused_from_content_length(make_proxy: Any) -> None:
    p = await make_proxy(max_body_bytes=1000)
    resp = await p.chat(chat_body(user("x" * 5000)))
    assert resp.status == 413
    assert "over the limit of 1000 bytes" in (await resp.json())["error"]["message"]
    assert p.fake.requests == []
    _only_failure(p, CallStatus.REJECTED, "body_too_large")


@pytest.mark.parametrize("rollout", ["a" * 129, "bad$id", "..%2Fetc"])
async def test_bad_rollout_id_is_400(make_proxy: Any, rollout: str) -> None:
    p = await make_proxy()
    resp = await p.chat(chat_body(user("x")), rollout=None, headers={"X-Rollout-Id": rollout})
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_rollout_id"


async def test_require_rollout_id(make_proxy: Any) -> None:
    p = await make_proxy(require_rollout_id=True)
    resp = await p.chat(chat_body(user("x")), rollout=None)
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "rollout_id_required"
    assert (await p.chat(chat_body(user("x")), rollout="named")).status == 200


# -- upstream errors ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_4xx_is_relayed_and_recorded(make_proxy: Any, stream: bool) -> None:
    p = await make_proxy()
    resp = await p.chat(chat_body(user("x"), max_tokens=9000, stream=stream))
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert "max_model_len" in err["message"]
    assert err["param"] == "max_tokens"
    entry = _only_failure(p, CallStatus.UPSTREAM_ERROR, "upstream_400")
    assert entry.http_status == 400


async def test_upstream_5xx_is_relayed(make_proxy: Any) -> None:
    fake = FakeVLLM()
    fake.push(Turn(fault=Fault.http_error(503, {"error": {"message": "overloaded"}})))
    p = await make_proxy(fake=fake)
    resp = await p.chat(chat_body(user("x")))
    assert resp.status == 503
    assert "overloaded" in (await resp.json())["error"]["message"]
    _only_failure(p, CallStatus.UPSTREAM_ERROR, "upstream_503")


async def test_upstream_unreachable_is_502(make_proxy: Any) -> None:
    p = await make_proxy(upstream="http://127.0.0.1:9")
    resp = await p.chat(chat_body(user("x")))
    assert resp.status == 502
    assert (await resp.json())["error"]["code"] == "upstream_unreachable"
    _only_failure(p, CallStatus.UPSTREAM_ERROR, "upstream_unreachable")


async def test_upstream_first_byte_timeout_is_504(make_proxy: Any) -> None:
    fake = FakeVLLM()
    fake.push(Turn(fault=Fault.hang()))
    p = await make_proxy(fake=fake, upstream_first_byte_timeout=0.3)
    resp = await p.chat(chat_body(user("x")))
    assert resp.status == 504
    _only_failure(p, CallStatus.UPSTREAM_ERROR, "upstream_timeout")


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (Fault.reset_after(3), None),
        (Fault.malformed_sse(3), "malformed_json"),
        (Fault.truncate_after(3), None),
        (Fault.error_event(), "error_event"),
    ],
)
async def test_broken_stream_ends_with_error_event_and_no_done(
    make_proxy: Any, fault: Fault, reason: str | None
) -> None:
    fake = FakeVLLM()
    fake.push(Turn("some words to stream out here", fault=fault))
    p = await make_proxy(fake=fake)
    resp = await p.chat(chat_body(user("x"), stream=True))
    events = await _events(resp)
    assert b"data: [DONE]" not in events
    last = orjson.loads(events[-1][6:])
    assert "error" in last
    _only_failure(p, CallStatus.UPSTREAM_ERROR, reason)


async def test_stream_idle_timeout(make_proxy: Any) -> None:
    p = await make_proxy(fake=FakeVLLM(chunk_delay=1.0), upstream_idle_timeout=0.2)
    resp = await p.chat(chat_body(user("x"), stream=True))
    events = await _events(resp)
    assert b"data: [DONE]" not in events
    assert b"upstream_idle_timeout" in events[-1]
    _only_failure(p, CallStatus.UPSTREAM_ERROR, "upstream_idle_timeout")


# -- answered but not staged ----------------------------------------------------------------


@pytest.mark.parametrize("fault", [Fault.drop_token_ids(), Fault.usage_mismatch()])
async def test_missing_token_data_poisons_but_answers(make_proxy: Any, fault: Fault) -> None:
    fake = FakeVLLM()
    fake.push(Turn("hello", fault=fault))
    p = await make_proxy(fake=fake)
    resp = await p.chat(chat_body(user("x")))
    assert resp.status == 200
    assert resp.headers["X-Capture-Status"] == "capture_failed"
    body = await resp.json()
    assert body["choices"][0]["message"]["content"] == "hello"
    assert "prompt_token_ids" not in body
    _only_failure(p, CallStatus.CAPTURE_FAILED)
    assert p.state.capture.rollouts["r1"].poisoned


async def test_missing_token_ids_with_error_policy_is_503(make_proxy: Any) -> None:
    fake = FakeVLLM()
    fake.push(Turn("hello", fault=Fault.drop_token_ids()))
    p = await make_proxy(fake=fake, on_capture_failure="error")
    resp = await p.chat(chat_body(user("x")))
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "capture_failed"
    _only_failure(p, CallStatus.CAPTURE_FAILED, "missing_token_ids")


@pytest.mark.parametrize("policy", ["poison", "error"])
async def test_stream_capture_failure_per_policy(make_proxy: Any, policy: str) -> None:
    fake = FakeVLLM()
    fake.push(Turn("hello", fault=Fault.drop_token_ids(every=2)))
    p = await make_proxy(fake=fake, on_capture_failure=policy)
    resp = await p.chat(chat_body(user("x"), stream=True))
    events = await _events(resp)
    if policy == "poison":
        assert events[-2].startswith(b": capture-status capture_failed call_id=")
        assert events[-1] == b"data: [DONE]"
    else:
        assert b"data: [DONE]" not in events
        assert orjson.loads(events[-1][6:])["error"]["code"] == "capture_failed"
    _only_failure(p, CallStatus.CAPTURE_FAILED, "token_count_mismatch")


async def test_sink_error_poisons_and_readyz_reports_it(make_proxy: Any) -> None:
    def broken(point: str) -> None:
        raise OSError("disk I/O error")

    sink = MemorySink(fault=broken)
    p = await make_proxy(sink=sink)
    resp = await p.chat(chat_body(user("x")))
    assert resp.status == 200
    assert resp.headers["X-Capture-Status"] == "capture_failed"
    entry = _only_failure(p, CallStatus.CAPTURE_FAILED, "sink_error")
    assert "disk I/O error" in entry.message
    ready = await p.client.get("/readyz")
    assert ready.status == 503
    assert "sink failing" in (await ready.text())
    sink.fault = None  # the fault clears: the next call stages and readiness comes back
    assert (await p.chat(chat_body(user("y")))).headers["X-Capture-Status"] == "staged"
    assert (await p.client.get("/readyz")).status == 200


async def test_slow_sink_times_out_and_late_write_is_orphaned(make_proxy: Any) -> None:
    sink = MemorySink(delay=0.5)
    p = await make_proxy(sink=sink, stage_timeout=0.1)
    resp = await p.chat(chat_body(user("x")))
    assert resp.headers["X-Capture-Status"] == "capture_failed"
    _only_failure(p, CallStatus.CAPTURE_FAILED, "stage_timeout")
    # Marked orphaned at the deadline, before the late write lands; then the write lands.
    assert sink.orphaned() == {resp.headers["X-Capture-Call-Id"]}
    for _ in range(50):
        if sink.calls("r1", include_orphaned=True):
            break
        await asyncio.sleep(0.05)
    assert sink.calls("r1") == []
    assert len(sink.calls("r1", include_orphaned=True)) == 1
    assert sink.rollout_info("r1").poisoned


async def test_pending_stage_backlog_gives_503_with_retry_after(make_proxy: Any) -> None:
    sink = MemorySink(delay=0.5)
    p = await make_proxy(sink=sink, max_pending_stages=1, stage_timeout=5)
    first = asyncio.ensure_future(p.chat(chat_body(user("a"))))
    for _ in range(100):
        if p.state.capture.pending_stages:
            break
        await asyncio.sleep(0.01)
    second = await p.chat(chat_body(user("b")))
    assert second.status == 503
    assert second.headers["Retry-After"] == "1"
    assert (await second.json())["error"]["code"] == "staging_backlog"
    assert (await first).headers["X-Capture-Status"] == "staged"


async def test_client_disconnect_mid_stream_aborts_upstream_and_is_recorded(
    make_proxy: Any,
) -> None:
    p = await make_proxy(fake=FakeVLLM(chunk_delay=0.05))
    resp = await p.chat(chat_body(user("a long answer please"), stream=True))
    await resp.content.readline()
    resp.close()  # the client goes away
    for _ in range(100):
        if p.failures():
            break
        await asyncio.sleep(0.05)
    _only_failure(p, CallStatus.ABORTED, "client_disconnected")
    for _ in range(100):
        if p.fake.aborted:
            break
        await asyncio.sleep(0.05)
    assert p.fake.aborted == 1
