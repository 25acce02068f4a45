"""The captured route end to end: a real proxy in front of the fake vLLM, staging into SQLite."""

from __future__ import annotations

import base64
import hashlib
from array import array
from typing import Any

import orjson
import pytest

from capture_proxy.read.reader import Store
from capture_proxy.schemas.digest import verify_record
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.registry import open_sink, open_source
from capture_proxy.testing.fake_vllm import FakeToolCall, FakeVLLM, Turn
from tests.support.proxy_harness import chat_body, sse_lines, user

STRIPPED_TOP = ("prompt_token_ids", "prompt_logprobs", "kv_transfer_params")
STRIPPED_CHOICE = ("token_ids", "routed_experts")


def assert_matches_upstream(record: Any, produced: dict[str, Any]) -> None:
    """The staged ids and logprobs are what the upstream produced, bit for bit."""
    assert list(record.prompt_token_ids) == produced["prompt_token_ids"]
    assert list(record.completion_token_ids) == produced["completion_token_ids"]
    assert record.completion_logprobs.tobytes() == array("f", produced["logprobs"]).tobytes()
    assert record.finish_reason == produced["finish_reason"]


async def test_unary_call_is_staged_exactly_and_client_sees_plain_openai(make_proxy: Any) -> None:
    p = await make_proxy()
    resp = await p.chat(chat_body(user("hello there")))
    assert resp.status == 200
    assert resp.headers["X-Capture-Status"] == "staged"
    call_id = resp.headers["X-Capture-Call-Id"]
    body = await resp.json()
    for key in STRIPPED_TOP:
        assert key not in body
    for key in (*STRIPPED_CHOICE, "logprobs"):
        assert body["choices"][0].get(key) is None
    assert body["choices"][0]["message"]["content"]

    (record,) = p.calls()
    assert record.call_id == call_id
    assert record.seq == 0
    assert record.rollout_id == "r1"
    assert_matches_upstream(record, p.fake.responses[0])
    assert record.upstream_version == "0.32.0"
    assert record.tokenizer_fingerprint.startswith("sha256:")
    assert record.response["content"] == body["choices"][0]["message"]["content"]
    assert record.response["reasoning_content"] == body["choices"][0]["message"]["reasoning"]
    verify_record(record)
    # What went upstream asked for the token data, without rewriting the client's logprob tokens.
    sent = p.fake.requests[0]
    assert sent["return_token_ids"] is True
    assert sent["logprobs"] is True
    assert sent["top_logprobs"] == 0
    assert "return_tokens_as_token_ids" not in sent
    # Nobody declared the upstream's logprobs mode, and the proxy knows nothing of the rest of
    # record schema 2 yet: every such field says "unknown / not used".
    assert record.schema_version == 2
    assert record.logprobs_mode == "unknown"
    assert (record.engine_weight_version, record.weight_spans, record.replica) == (None, (), "")
    assert (record.token_in, record.bridge_spans, record.effective_sampling) == (False, (), None)


async def test_declared_upstream_logprobs_mode_is_stamped_on_every_record(
    make_proxy: Any,
) -> None:
    p = await make_proxy(upstream_logprobs_mode="processed_logprobs")
    for stream in (False, True):
        resp = await p.chat(chat_body(user("hi"), stream=stream))
        assert resp.status == 200
        await resp.read()
    records = p.calls()
    assert [r.logprobs_mode for r in records] == ["processed_logprobs"] * 2
    for record in records:
        verify_record(record)


def test_an_undeclared_logprobs_mode_is_refused_naming_the_setting() -> None:
    from capture_proxy.server.settings import SettingsError, load_settings

    env = {"CAPTURE_PROXY_UPSTREAM_LOGPROBS_MODE": "raw_logits"}
    with pytest.raises(SettingsError, match="CAPTURE_PROXY_UPSTREAM_LOGPROBS_MODE must be one of"):
        load_settings(environ=env)


async def test_client_that_asked_for_logprobs_gets_them(make_proxy: Any) -> None:
    p = await make_proxy()
    resp = await p.chat(chat_body(user("hi"), logprobs=True, top_logprobs=2))
    body = await resp.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(p.fake.responses[0]["completion_token_ids"])
    assert all(
        len(c["top_logprobs"]) == 2 and not c["token"].startswith("token_id:") for c in content
    )
    assert p.fake.requests[0]["top_logprobs"] == 2


async def test_stream_relays_chunks_then_status_comment_then_done(make_proxy: Any) -> None:
    p = await make_proxy()
    resp = await p.chat(chat_body(user("stream please"), stream=True))
    assert resp.status == 200
    assert resp.headers["X-Capture-Status"] == "pending"
    lines = [line async for line in sse_lines(resp)]
    events = [line for line in lines if line]
    assert events[-1] == b"data: [DONE]"
    assert (
        events[-2]
        == f": capture-status staged call_id={resp.headers['X-Capture-Call-Id']}".encode()
    )
    chunks = [orjson.loads(e[6:]) for e in events[:-2]]
    assert all(c["choices"] for c in chunks), "usage chunk relayed although not asked for"
    for c in chunks:
        assert "prompt_token_ids" not in c
        assert "token_ids" not in c["choices"][0]
        assert c["choices"][0].get("logprobs") is None
    (record,) = p.calls()
    assert_matches_upstream(record, p.fake.responses[0])
    # The proxy asked for usage to cross-check counts, and did not relay it.
    assert p.fake.requests[0]["stream_options"] == {"include_usage": True}


async def test_stream_relays_usage_when_client_asked(make_proxy: Any) -> None:
    p = await make_proxy()
    resp = await p.chat(chat_body(user("x"), stream=True, stream_options={"include_usage": True}))
    events = [line async for line in sse_lines(resp) if line]
    usage = [orjson.loads(e[6:]) for e in events if e.startswith(b"data: {") and b'"usage"' in e]
    assert usage
    assert usage[-1]["choices"] == []
    (record,) = p.calls()
    assert usage[-1]["usage"]["completion_tokens"] == len(record.completion_token_ids)


async def test_tool_call_stream_and_replay_with_reasoning_links_parent(make_proxy: Any) -> None:
    fake = FakeVLLM()
    fake.push(
        Turn("", reasoning="I should look.", tool_calls=[FakeToolCall("bash", {"command": "ls"})]),
        Turn("Two files.", reasoning="Done."),
    )
    p = await make_proxy(fake=fake)
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    first = chat_body(user("list files"), stream=True, tools=tools, tool_choice="auto")
    resp = await p.chat(first)
    events = [
        orjson.loads(e[6:]) for e in [x async for x in sse_lines(resp)] if e.startswith(b"data: {")
    ]
    calls = [tc for e in events for tc in (e["choices"][0]["delta"].get("tool_calls") or [])]
    call_id = calls[0]["id"]
    arguments = "".join(tc["function"].get("arguments", "") for tc in calls)
    reasoning = "".join(e["choices"][0]["delta"].get("reasoning") or "" for e in events)
    # Replay as OpenCode does with interleaved field "reasoning", tool arguments as received.
    replay = chat_body(
        user("list files"),
        {
            "role": "assistant",
            "content": "",
            "reasoning": reasoning,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "bash", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "a.txt\nb.txt"},
        stream=True,
        tools=tools,
        tool_choice="auto",
    )
    resp2 = await p.chat(replay)
    assert [x async for x in sse_lines(resp2) if x][-1] == b"data: [DONE]"
    # The upstream got the canonical reasoning_content, not the client's `reasoning`.
    sent = p.fake.requests[1]["messages"][1]
    assert sent["reasoning_content"] == reasoning
    assert "reasoning" not in sent
    r1, r2 = p.calls()
    assert r1.response["tool_calls"][0]["function"]["arguments"] == arguments
    assert r2.parent_call_id == r1.call_id
    assert r2.request["messages"][1]["reasoning_content"] == reasoning
    coords = open_source(p.store_url).coords([r2.call_id])[0]
    assert coords.prev_len == r1.cum_len  # replayed unchanged: no drift
    assert coords.delta_len == r2.cum_len - r1.cum_len
    for r, produced in zip((r1, r2), p.fake.responses, strict=True):
        assert_matches_upstream(r, produced)


async def test_reasoning_sent_as_reasoning_to_vllm_0_20(make_proxy: Any) -> None:
    p = await make_proxy(fake=FakeVLLM(version="0.20.1"))
    msgs = [
        user("a"),
        {"role": "assistant", "content": "b", "reasoning_content": "think"},
        user("c"),
    ]
    resp = await p.chat(chat_body(*msgs))
    assert resp.status == 200
    sent = p.fake.requests[0]["messages"][1]
    assert sent["reasoning"] == "think"
    assert "reasoning_content" not in sent
    (record,) = p.calls()
    assert record.request["messages"][1]["reasoning_content"] == "think"


async def test_retry_is_linked_and_not_a_parent(make_proxy: Any) -> None:
    p = await make_proxy()
    body = chat_body(user("same question"))
    for _ in range(2):
        assert (await p.chat(body)).headers["X-Capture-Status"] == "staged"
    first, second = p.calls()
    assert second.retry_of == first.call_id
    assert second.parent_call_id is None


async def test_image_becomes_an_attachment_referenced_by_sha256(make_proxy: Any) -> None:
    p = await make_proxy()
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    for _ in range(2):  # OpenCode re-sends the image with every call
        resp = await p.chat(chat_body({"role": "user", "content": content}))
        assert resp.headers["X-Capture-Status"] == "staged"
    sha = hashlib.sha256(png).hexdigest()
    with Store(open_source(p.store_url)) as store:
        records = store.fetch([r.call_id for r in p.calls()])
        store.verify()
    for record in records:
        part = record.request["messages"][0]["content"][1]
        assert part["image_url"]["url"] == f"attachment:sha256:{sha}"
        (att,) = record.attachments
        assert att.sha256 == sha
        assert att.data == png
        assert att.media_type == "image/png"
    # The upstream got the image itself.
    assert p.fake.requests[0]["messages"][0]["content"][1]["image_url"]["url"] == url


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_one_image_sent_as_png_then_as_jpeg_stages_and_verifies_both(
    make_proxy: Any, tmp_path: Any, kind: str
) -> None:
    """Clients label bytes as they like: the same bytes as image/png, then as image/jpeg, are
    stored once, and each record keeps (and its digest binds) the media type it was sent with."""
    url = f"sqlite:///{tmp_path / 'two.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/two"
    p = await make_proxy(sink=open_sink(url))
    png = b"\x89PNG\r\n\x1a\n" + hashlib.sha256(b"two types").digest() * 32
    data = base64.b64encode(png).decode()
    for media_type in ("image/png", "image/jpeg"):
        part = {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
        content = [{"type": "text", "text": f"as {media_type}"}, part]
        resp = await p.chat(chat_body({"role": "user", "content": content}))
        assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
    with Store(open_source(url)) as store:  # read beside the live writer
        records = store.calls("r1", include_open=True)
        store.verify()
    assert [[(a.media_type, a.data) for a in r.attachments] for r in records] == [
        [("image/png", png)],
        [("image/jpeg", png)],
    ]


async def test_policy_knobs_cap_max_tokens_and_rename_model(make_proxy: Any) -> None:
    p = await make_proxy(max_tokens_cap=64, served_model="policy")
    resp = await p.chat({"model": "title-model", "messages": [user("x")], "max_tokens": 32000})
    assert resp.status == 200
    assert p.fake.requests[0]["max_tokens"] == 64
    assert p.fake.requests[0]["model"] == "policy"
    (record,) = p.calls()
    assert record.sampling["max_tokens"] == 64
    assert record.model == "policy"


async def test_rollout_from_header_session_id_and_anonymous(make_proxy: Any) -> None:
    p = await make_proxy()
    await p.chat(chat_body(user("a")), rollout=None, headers={"X-Rollout-Id": "from-header"})
    await p.chat(chat_body(user("b")), rollout=None, headers={"x-session-id": "ses_123"})
    await p.chat(chat_body(user("c")), rollout=None)
    assert [len(p.calls(r)) for r in ("from-header", "ses_123", "anonymous")] == [1, 1, 1]


async def test_manifest_order_and_status_counts_in_metrics(make_proxy: Any) -> None:
    p = await make_proxy()
    await p.chat(chat_body(user("ok")))
    await p.chat(chat_body({"role": "user", "content": "x", "bogus": 1}))
    text = await (await p.client.get("/metrics")).text()
    assert 'capture_proxy_calls_total{outcome="staged",reason="ok"} 1.0' in text
    assert 'capture_proxy_calls_total{outcome="rejected",reason="unknown_field"} 1.0' in text
    outcomes = sorted(p.state.capture.rollouts["r1"].outcomes.values(), key=lambda o: o.seq)
    assert [o.status for o in outcomes] == [CallStatus.STAGED, CallStatus.REJECTED]


async def test_large_image_body_is_normalized_off_the_event_loop_and_staged(
    make_proxy: Any,
) -> None:
    p = await make_proxy()
    png = (
        b"\x89PNG\r\n\x1a\n" + hashlib.sha256(b"seed").digest() * 40_000
    )  # ~1.3 MB: the offload path
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}]
    resp = await p.chat(chat_body({"role": "user", "content": content}))
    assert resp.headers["X-Capture-Status"] == "staged"
    (record,) = p.calls()
    assert record.attachments[0].data == png
