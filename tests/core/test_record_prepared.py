"""The record's request-side work is done while the upstream generates, and the records it
seals are exactly the ones sealed without it."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

from capture_proxy.adapters.vllm import Completion
from capture_proxy.core.capture import Capture
from capture_proxy.schemas.digest import encode_request, seal_record, verify_record
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user


async def test_the_request_part_of_the_digest_is_ready_before_the_answer(tmp_path: Path) -> None:
    parts: list[tuple[bytes | None, bytes]] = []

    def answer(body: dict[str, Any]) -> Turn:
        # The upstream has the request and has not answered: what the call holds by now.
        [call] = p.state.capture.calls.values()
        parts.append((call.request_part, encode_request(call.request)))
        return Turn(content="hi")

    p = await start_proxy(tmp_path, fake=FakeVLLM(script=answer))
    try:
        resp = await p.chat(chat_body(user("hello")), rollout="ep")
        assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
        [(ahead, expected)] = parts
        assert ahead == expected
        [record] = p.calls("ep")
        verify_record(record)  # the digest recomputed from scratch, without the part
        assert seal_record(record).digest == record.digest
    finally:
        await stop_proxy(p)


async def test_a_rollouts_later_calls_verify_with_their_parts(tmp_path: Path) -> None:
    p = await start_proxy(tmp_path)
    try:
        history = [user("hello")]
        for text in ("go on", "and then?"):
            resp = await p.chat(chat_body(*history), rollout="ep")
            assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
            answer = (await resp.json())["choices"][0]["message"]
            history += [{"role": "assistant", "content": answer["content"]}, user(text)]
        records = p.calls("ep")
        assert len(records) == 2
        for record in records:
            verify_record(record)
    finally:
        await stop_proxy(p)


async def test_a_request_that_cannot_be_encoded_ahead_is_refused_when_sealed() -> None:
    # A lone surrogate is no UTF-8 string: the request is left unencoded ahead, and the record
    # is refused when it is sealed: capture_failed, invalid_record, naming the field.
    capture = Capture(MemorySink())
    await capture.ensure_rollout("ep")
    request = {"messages": [{"role": "user", "content": "hi"}], "user": "\ud800"}
    call = capture.begin_call("ep", request, key=b"k")  # admission encodes it otherwise
    capture.prepare_record(call)
    assert call.request_part is None
    answer = Completion(
        response_id="x",
        model="policy",
        prompt_token_ids=array("i", [1, 2]),
        completion_token_ids=array("i", [3]),
        completion_logprobs=array("f", [-0.5]),
        finish_reason="stop",
        stop_reason=None,
        message={"role": "assistant", "content": "ok", "reasoning_content": None},
        usage={},
        extras={},
    )
    result = await capture.complete_call(call, answer, model="policy")
    assert result.status is CallStatus.CAPTURE_FAILED
    assert result.reason == "invalid_record"
    assert "request.user" in (result.message or "")
