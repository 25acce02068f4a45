"""StreamAccumulator: real vLLM 0.32 streams, relay stripping, broken streams, split fuzzing."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.adapters.sse import SSEParser
from capture_proxy.adapters.vllm import (
    CaptureExtractionError,
    ClientWants,
    Completion,
    ForwardPlan,
    StreamAccumulator,
    UpstreamProtocolError,
    VLLMAdapter,
)
from capture_proxy.adapters.vllm._chunk import read_token_chunk
from capture_proxy.adapters.vllm._wire import (
    decode_choices,
    decode_object,
    encode,
    strip_for_client,
)
from tests.support import FIXTURES

FIXTURES = next(
    p
    for p in (
        FIXTURES / "vllm-0.32.0",
        Path("/work/shared/fixtures/vllm-0.32.0"),
    )
    if p.is_dir()
)
CHAT_SSE = (FIXTURES / "chat-stream.sse").read_bytes()
TOOL_SSE = (FIXTURES / "tool-call-stream.sse").read_bytes()
CAPTURE_KEYS = ("return_token_ids", "logprobs", "top_logprobs", "return_tokens_as_token_ids")
STRIPPED_TOP = ("prompt_token_ids", "prompt_text", "usage")


def plan_for(name: str = "chat-request.json", **client: Any) -> ForwardPlan:
    req = json.loads((FIXTURES / name).read_bytes())
    for key in CAPTURE_KEYS:
        req.pop(key, None)
    req.update(stream=True, **client)
    return VLLMAdapter().plan(req)


def run(
    stream: bytes, plan: ForwardPlan | None = None, cuts: list[int] | None = None
) -> tuple[StreamAccumulator, list[bytes]]:
    """Feed `stream` cut at `cuts`; returns the accumulator (not finished) and relayed events."""
    acc = VLLMAdapter().stream(plan or plan_for())
    relayed: list[bytes] = []
    start = 0
    for cut in sorted(cuts or []):
        relayed += acc.feed(stream[start:cut])
        start = cut
    relayed += acc.feed(stream[start:])
    return acc, relayed


def finish(stream: bytes, plan: ForwardPlan | None = None) -> Completion:
    acc, _ = run(stream, plan)
    return acc.finish()


def chunks(stream: bytes) -> list[Any]:
    """The stream's data payloads, decoded (``"[DONE]"`` kept as a string)."""
    parser = SSEParser()
    events = parser.feed(stream) + parser.close()
    assert not parser.pending
    return [e.data.decode() if e.data == b"[DONE]" else orjson.loads(e.data) for e in events]


def sse(payloads: list[Any]) -> bytes:
    return b"".join(
        b"data: " + (p.encode() if isinstance(p, str) else orjson.dumps(p)) + b"\n\n"
        for p in payloads
    )


def unstreamed(name: str) -> Completion:
    raw = (FIXTURES / name).read_bytes()
    return VLLMAdapter().parse_response(raw, plan_for())[0]


# --- the fixtures --------------------------------------------------------------------------


def test_reasoning_stream_equals_the_unstreamed_answer() -> None:
    got = finish(CHAT_SSE)
    want = unstreamed("chat-response.json")
    for field in (
        "prompt_token_ids",
        "completion_token_ids",
        "completion_logprobs",
        "finish_reason",
        "stop_reason",
        "message",
        "usage",
        "model",
    ):
        assert getattr(got, field) == getattr(want, field), field
    assert got.completion_logprobs.typecode == "f"
    assert got.response_id == "chatcmpl-ae09f0c1c891946b"
    assert got.extras == {
        "upstream_response_id": "chatcmpl-ae09f0c1c891946b",
        "system_fingerprint": "vllm-0.32.0-289ee19c",
        "stop_reason": None,
    }


def test_tool_call_stream_equals_the_unstreamed_answer() -> None:
    got = finish(TOOL_SSE, plan_for("tool-call-request.json"))
    want = unstreamed("tool-call-response.json")
    assert len(got.completion_token_ids) == 48
    assert got.completion_token_ids == want.completion_token_ids
    assert got.completion_logprobs == want.completion_logprobs
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.finish_reason == want.finish_reason == "tool_calls"
    assert got.usage == want.usage
    # The two fixtures come from two runs, so only the tool call ids differ.
    [streamed_call] = got.message["tool_calls"]
    [plain_call] = want.message["tool_calls"]
    assert streamed_call["function"] == plain_call["function"]
    assert streamed_call["function"] == {"name": "bash", "arguments": '{"command": "ls -la"}'}
    assert streamed_call["id"] == "chatcmpl-tool-bb77dc9060689731"
    assert streamed_call["type"] == "function"
    assert got.message["content"] is None
    assert got.message["reasoning_content"] is None


@pytest.mark.parametrize("stream", [CHAT_SSE, TOOL_SSE], ids=["chat", "tool"])
def test_relay_strips_token_fields_and_drops_usage_and_done(stream: bytes) -> None:
    acc, relayed = run(stream)
    assert acc.saw_done
    upstream = chunks(stream)
    assert upstream[-1] == "[DONE]"
    assert upstream[-2]["choices"] == []  # the usage-only chunk
    expected = []
    for chunk in upstream[:-2]:
        for key in STRIPPED_TOP:
            chunk.pop(key, None)
        for choice in chunk["choices"]:
            choice.pop("token_ids", None)
            choice["logprobs"] = None
        expected.append(chunk)
    assert all(r.endswith(b"\n\n") and r.startswith(b"data: ") for r in relayed)
    assert chunks(b"".join(relayed)) == expected
    assert b"[DONE]" not in b"".join(relayed)
    acc.finish()


def test_client_that_asked_for_everything_gets_vllms_bytes() -> None:
    plan = plan_for(
        logprobs=True,
        return_token_ids=True,
        return_tokens_as_token_ids=True,
        stream_options={"include_usage": True},
    )
    acc, relayed = run(CHAT_SSE, plan)
    # Nothing to strip: every event is relayed as the exact bytes that arrived.
    assert b"".join(relayed) == CHAT_SSE[: -len(b"data: [DONE]\n\n")]
    assert acc.finish().completion_token_ids == array("i", [210] * 6)


def test_usage_chunk_relayed_when_the_client_asked() -> None:
    _, relayed = run(CHAT_SSE, plan_for(stream_options={"include_usage": True}))
    last = orjson.loads(relayed[-1][6:])
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 6


def test_per_chunk_usage_is_stripped_unless_asked() -> None:
    # continuous_usage_stats puts usage on every chunk once the proxy turns include_usage on.
    payloads = chunks(CHAT_SSE)
    for i, chunk in enumerate(payloads[:-2]):
        chunk["usage"] = {"prompt_tokens": 167, "completion_tokens": i, "total_tokens": 167 + i}
    stream = sse(payloads)
    acc, relayed = run(stream, plan_for(stream_options={"continuous_usage_stats": True}))
    assert all("usage" not in c for c in chunks(b"".join(relayed)))
    assert acc.finish().usage["completion_tokens"] == 6
    _, relayed = run(stream, plan_for(stream_options={"include_usage": True}))
    seen = [c["usage"]["completion_tokens"] for c in chunks(b"".join(relayed))]
    assert seen == [0, 1, 2, 3, 4, 5, 6, 6]


def test_comments_are_dropped() -> None:
    stream = b": keep-alive\n\n" + CHAT_SSE.replace(b"data: [DONE]", b": note\ndata: [DONE]")
    first = CHAT_SSE.index(b"\n\n") + 2
    stream = stream.replace(CHAT_SSE[first:], b": inline\n" + CHAT_SSE[first:], 1)
    acc, relayed = run(stream, plan_for(logprobs=True, return_token_ids=True))
    out = b"".join(relayed)
    assert b"keep-alive" not in out
    assert b"inline" not in out
    assert b"note" not in out
    assert chunks(b"".join(relayed)) == chunks(CHAT_SSE)[:-2]
    assert acc.finish() == finish(CHAT_SSE)


def test_crlf_stream_gives_the_same_completion() -> None:
    acc, relayed = run(CHAT_SSE.replace(b"\n", b"\r\n"))
    assert acc.finish() == finish(CHAT_SSE)
    assert chunks(b"".join(relayed)) == chunks(b"".join(run(CHAT_SSE)[1]))


def test_old_vllm_reasoning_content_deltas_and_token_id_fallback() -> None:
    payloads = chunks(CHAT_SSE)
    for chunk in payloads[1:-2]:
        choice = chunk["choices"][0]
        choice["delta"] = {"reasoning_content": choice["delta"]["reasoning"]}
        del choice["token_ids"]  # the logprob tokens are "token_id:210"
    got = finish(sse(payloads))
    assert got.message["reasoning_content"] == "\n" * 6
    assert got.completion_token_ids == array("i", [210] * 6)


def test_stop_reason_and_extras_from_the_finish_chunk() -> None:
    payloads = chunks(CHAT_SSE)
    payloads[-3]["choices"][0]["stop_reason"] = "</s>"
    payloads[-3]["choices"][0]["routed_experts"] = "AAEC"
    _, relayed = run(sse(payloads))
    assert b"routed_experts" not in b"".join(relayed)
    acc, _ = run(sse(payloads))
    got = acc.finish()
    assert got.stop_reason == "</s>"
    assert got.extras["routed_experts"] == "AAEC"


# --- broken streams ------------------------------------------------------------------------


def protocol_error(stream: bytes, reason: str) -> UpstreamProtocolError:
    acc, _ = run(stream)
    with pytest.raises(UpstreamProtocolError) as info:
        acc.finish()
    assert info.value.reason == reason, info.value
    return info.value


def test_truncated_at_every_byte() -> None:
    full_relay = b"".join(run(CHAT_SSE)[1])
    boundaries = {i + 2 for i in range(len(CHAT_SSE)) if CHAT_SSE[i : i + 2] == b"\n\n"}
    finish_end = CHAT_SSE.index(b'"finish_reason":"length"')
    finish_end = CHAT_SSE.index(b"\n\n", finish_end) + 2
    for cut in range(len(CHAT_SSE)):
        acc, relayed = run(CHAT_SSE[:cut])
        # What was relayed is a prefix of the full relay: nothing invented, nothing reordered.
        assert full_relay.startswith(b"".join(relayed))
        with pytest.raises(UpstreamProtocolError) as info:
            acc.finish()
        if cut == 0:
            expected = "empty_stream"
        elif cut not in boundaries:
            expected = "truncated_event"
        elif cut < finish_end:
            expected = "missing_finish_reason"
        else:
            expected = "missing_done"
        assert info.value.reason == expected, cut


def test_malformed_json_stops_the_relay() -> None:
    events = CHAT_SSE.split(b"\n\n")
    events[2] = events[2][:-5]
    stream = b"\n\n".join(events)
    acc, relayed = run(stream)
    assert len(relayed) == 2
    assert acc.failed
    assert acc.feed(b"data: {}\n\n") == []
    err = protocol_error(stream, "malformed_json")
    assert err.error_body["error"]["code"] == 502


@pytest.mark.parametrize(
    "error",
    [
        {
            "error": {
                "message": "engine died",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        },
        {"object": "error", "message": "engine died", "type": "InternalServerError", "code": 500},
    ],
)
def test_error_event_mid_stream(error: dict[str, Any]) -> None:
    payloads = chunks(CHAT_SSE)
    stream = sse([*payloads[:3], error, "[DONE]"])
    _, relayed = run(stream)
    assert len(relayed) == 3  # the chunks before the error; the error itself is not relayed
    err = protocol_error(stream, "error_event")
    assert err.message == "engine died"
    assert err.error_body["error"]["type"] == "InternalServerError"


def test_stream_errors_by_shape() -> None:
    payloads = chunks(CHAT_SSE)
    protocol_error(sse([*payloads, payloads[1]]), "data_after_done")
    protocol_error(sse([*payloads[:2], {"id": "x"}, *payloads[2:]]), "no_choices")
    protocol_error(sse([[1, 2]]), "malformed_json")
    protocol_error(b": only a comment\n\n", "empty_stream")


def test_max_event_size_is_enforced() -> None:
    acc = StreamAccumulator(plan_for().wants, max_event_size=64)
    assert acc.feed(CHAT_SSE) == []
    assert acc.failed
    with pytest.raises(UpstreamProtocolError) as info:
        acc.finish()
    assert info.value.reason == "event_too_large"
    with pytest.raises(RuntimeError, match="after finish"):
        acc.feed(b"data: [DONE]\n\n")


# --- token data that cannot be staged ------------------------------------------------------


def extraction_error(payloads: list[Any], reason: str) -> CaptureExtractionError:
    acc, relayed = run(sse(payloads))
    assert relayed  # the client got the answer
    with pytest.raises(CaptureExtractionError) as info:
        acc.finish()
    assert info.value.reason == reason, info.value
    return info.value


def test_missing_token_ids_without_fallback() -> None:
    payloads = chunks(TOOL_SSE)  # text logprob tokens: no "token_id:N" fallback
    del payloads[5]["choices"][0]["token_ids"]
    extraction_error(payloads, "missing_token_ids")


def test_missing_prompt_ids() -> None:
    payloads = chunks(CHAT_SSE)
    del payloads[0]["prompt_token_ids"]
    extraction_error(payloads, "missing_token_ids")


def test_lost_tokens_are_a_count_mismatch() -> None:
    payloads = chunks(TOOL_SSE)
    # What older vLLM tool parsers did (vLLM #27482): a chunk without its token data.
    del payloads[30]["choices"][0]["token_ids"]
    payloads[30]["choices"][0]["logprobs"] = None
    err = extraction_error(payloads, "token_count_mismatch")
    assert "completion ids 47 vs usage.completion_tokens 48 vs logprobs 47" in err.message


def test_missing_logprobs_and_usage() -> None:
    payloads = chunks(CHAT_SSE)
    for chunk in payloads[1:-2]:
        chunk["choices"][0]["logprobs"] = None
    extraction_error(payloads, "missing_logprobs")
    payloads = chunks(CHAT_SSE)
    extraction_error([*payloads[:-2], "[DONE]"], "missing_usage")


def test_multiple_choices_and_oversized_ids() -> None:
    payloads = chunks(CHAT_SSE)
    payloads[2]["choices"].append({**payloads[2]["choices"][0], "index": 1})
    extraction_error(payloads, "multiple_choices")
    payloads = chunks(CHAT_SSE)
    payloads[2]["choices"][0]["token_ids"] = [2**31]
    extraction_error(payloads, "invalid_token_ids")
    payloads = chunks(CHAT_SSE)
    payloads[2]["choices"][0]["routed_experts"] = "AA"
    payloads[3]["choices"][0]["routed_experts"] = "BB"
    extraction_error(payloads, "routed_experts_split")


def test_media_spans_must_be_a_list_of_objects() -> None:
    for spans in ("3-10", 7, [[3, 10]], [{"start": 3, "end": 10}, "x"]):
        payloads = chunks(CHAT_SSE)
        payloads[-3]["choices"][0]["media_spans"] = spans
        assert "media_spans" in extraction_error(payloads, "invalid_media_spans").message
    payloads = chunks(CHAT_SSE)
    payloads[0]["media_spans"] = "3-10"  # at the top level of a chunk too
    extraction_error(payloads, "invalid_media_spans")
    payloads = chunks(CHAT_SSE)
    payloads[-3]["choices"][0]["media_spans"] = [{"start": 3, "end": 10}]
    assert finish(sse(payloads)).extras["media_spans"] == [{"start": 3, "end": 10}]


# --- chunk boundaries never matter ---------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    which=st.sampled_from(["chat", "tool", "chat-crlf"]),
    asks=st.booleans(),
    data=st.data(),
)
def test_any_split_gives_identical_completion_and_relay(
    which: str, asks: bool, data: st.DataObject
) -> None:
    stream = {"chat": CHAT_SSE, "tool": TOOL_SSE, "chat-crlf": CHAT_SSE.replace(b"\n", b"\r\n")}
    body = stream[which]
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(body)), max_size=40))
    plan = plan_for(logprobs=True, stream_options={"include_usage": True}) if asks else plan_for()
    whole_acc, whole = run(body, plan)
    split_acc, split = run(body, plan, cuts)
    assert split == whole
    assert split_acc.finish() == whole_acc.finish()


def test_every_single_cut_of_a_crlf_stream_relays_the_same_bytes() -> None:
    # Cuts between "\r" and "\n" are the classic SSE relay bug; try every one deterministically.
    body = CHAT_SSE.replace(b"\n", b"\r\n")
    plan = plan_for(logprobs=True, return_token_ids=True, stream_options={"include_usage": True})
    whole_acc, whole = run(body, plan)
    completion = whole_acc.finish()
    assert b"".join(whole) == body[: body.index(b"data: [DONE]")]
    for cut in range(1, len(body)):
        acc, relayed = run(body, plan, [cut])
        assert relayed == whole, cut
        assert acc.finish() == completion, cut


# --- the token-chunk fast path relays what the generic path relays ---------------------------


def generic_relay(data: bytes, wants: ClientWants) -> bytes:
    top = decode_object(data)
    stripped = strip_for_client(top, decode_choices(top["choices"]), wants)
    return b"data: " + (data if stripped is None else encode(stripped)) + b"\n\n"


ASKS: list[dict[str, Any]] = [
    {},
    {"logprobs": True},
    {"return_token_ids": True},
    {"logprobs": True, "return_token_ids": True},
]
WANTS = [plan_for(**asks).wants for asks in ASKS]


@pytest.mark.parametrize("stream", [CHAT_SSE, TOOL_SSE], ids=["chat", "tool"])
@pytest.mark.parametrize("wants", WANTS)
def test_fast_path_takes_the_token_chunks_and_relays_the_generic_bytes(
    stream: bytes, wants: ClientWants
) -> None:
    events = SSEParser().feed(stream)
    fast = 0
    for event in events:
        got = read_token_chunk(event.data, event.raw, False, wants)
        if got is None:
            continue
        fast += 1
        assert got[2] == generic_relay(event.data, wants)
    # All but the first chunk (prompt ids), the finish chunk (stop_reason), usage and [DONE].
    assert fast == len(events) - 4


_TEXT = st.text(alphabet=st.sampled_from('ab{}[]",:\\ \n\u00e9\U0001f600'), max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    content=_TEXT,
    token=_TEXT,
    ids=st.one_of(st.none(), st.lists(st.integers(0, 2**31 - 1), max_size=3)),
    logprobs=st.booleans(),
    finish=st.sampled_from([None, "stop"]),
    extra=st.sampled_from([None, "system_fingerprint", "usage", "nested"]),
    wants=st.sampled_from(WANTS),
)
def test_fast_path_never_differs_from_the_generic_path(
    content: str,
    token: str,
    ids: list[int] | None,
    logprobs: bool,
    finish: str | None,
    extra: str | None,
    wants: ClientWants,
) -> None:
    entry = {"token": token, "logprob": -0.25, "bytes": [1], "top_logprobs": []}
    if extra == "nested":  # a look-alike key inside the logprobs value
        entry["logprobs"] = {"finish_reason": content}
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"content": content, "reasoning": token},
        "logprobs": {"content": [entry]} if logprobs else None,
        "finish_reason": finish,
        "token_ids": ids,
    }
    chunk: dict[str, Any] = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }
    if extra in ("system_fingerprint", "usage"):
        chunk[extra] = "x" if extra == "system_fingerprint" else {"prompt_tokens": 1}
    data = orjson.dumps(chunk)
    got = read_token_chunk(data, b"data: " + data + b"\n\n", False, wants)
    if extra in ("system_fingerprint", "usage"):
        assert got is None
    if got is not None:
        assert got[2] == generic_relay(data, wants)
        assert got[0].delta.content == content
        assert got[0].token_ids == ids


def test_session_streams_give_the_ids_of_a_sessionless_stream() -> None:
    adapter = VLLMAdapter()
    want = finish(CHAT_SSE)
    for _ in range(3):  # the second and third reuse the session's cached prompt + completion
        acc = adapter.stream(plan_for(), session="r7")
        acc.feed(CHAT_SSE)
        assert acc.finish() == want
    entry = adapter.prefixes.get("r7")
    assert entry is not None
    assert entry.ids == want.prompt_token_ids + want.completion_token_ids


def test_malformed_prompt_ids_fail_the_stream_at_its_end() -> None:
    # The prompt ids are decoded at the end (off the time to first byte): the stream still
    # fails as malformed, and the client never gets [DONE] from the proxy.
    payloads = chunks(CHAT_SSE)
    payloads[0]["prompt_token_ids"] = [1, "x"]
    acc, relayed = run(sse(payloads))
    assert relayed
    with pytest.raises(UpstreamProtocolError) as info:
        acc.finish()
    assert info.value.reason == "malformed_json"
