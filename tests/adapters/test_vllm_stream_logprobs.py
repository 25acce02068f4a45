"""`StreamLogprobs`: the unary derender requests that resolve a streamed token-in answer's
logprobs, built from vLLM 0.32's captured generate events, and their answers read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from capture_proxy.adapters.vllm import StreamLogprobs, UpstreamProtocolError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm-0.32.0" / "token-in"


def events(name: str) -> list[bytes]:
    raw = (FIXTURES / name).read_bytes()
    return [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: {")]


def answer(content: list[dict[str, Any]]) -> bytes:
    """A unary derender answer whose choice carries `content`, as vLLM's resolves them."""
    return orjson.dumps({"choices": [{"logprobs": {"content": content}}]})


def resolved(token_id: int) -> dict[str, Any]:
    return {"token": f"<{token_id}>", "logprob": -1.0, "bytes": [], "top_logprobs": []}


def test_each_request_carries_its_chunk_after_the_ids_sampled_before_it() -> None:
    stream = events("generate-chat-stream.sse")[:6]
    lp = StreamLogprobs("policy")
    bodies = [lp.request(e) for e in stream]
    sampled = [orjson.loads(e)["choices"][0] for e in stream]
    for i, body in enumerate(bodies):
        assert body is not None
        request = orjson.loads(body)
        assert request["prompt_token_ids"] == []
        assert request["chat_request"] == {
            "model": "policy",
            "messages": [{"role": "user", "content": ""}],
        }
        [choice] = request["generate_response"]["choices"]
        before = [t for c in sampled[max(0, i - 4) : i] for t in c["token_ids"]][-4:]
        assert choice["token_ids"] == before + sampled[i]["token_ids"]
        entries = choice["logprobs"]["content"]
        assert [e["token_id"] for e in entries] == choice["token_ids"]
        # The chunk's own entries as generate sent them, top logprobs included.
        assert entries[len(before) :] == sampled[i]["logprobs"]["content"]


def test_the_answer_is_the_chunks_own_logprobs_without_the_context() -> None:
    lp = StreamLogprobs("policy")
    stream = events("generate-chat-stream.sse")
    for i, event in enumerate(stream[:6]):
        body = lp.request(event)
        assert body is not None
        ids = orjson.loads(body)["generate_response"]["choices"][0]["token_ids"]
        got = lp.read(answer([resolved(t) for t in ids]))
        assert len(got["content"]) == 1
        assert len(ids) == 1 + min(i, 4)


def test_a_chunk_without_logprobs_needs_no_request() -> None:
    lp = StreamLogprobs("policy")
    usage = b'{"request_id":"x","usage":{"prompt_tokens":1,"completion_tokens":1},"choices":[]}'
    assert lp.request(usage) is None
    plain = b'{"request_id":"x","choices":[{"index":0,"token_ids":[5,6],"logprobs":null}]}'
    assert lp.request(plain) is None
    # Their ids are still the context of the next chunk's.
    body = lp.request(
        b'{"request_id":"x","choices":[{"index":0,"token_ids":[7],'
        b'"logprobs":{"content":[{"token_id":7,"logprob":-0.5,"top_logprobs":[]}]}}]}'
    )
    assert body is not None
    assert orjson.loads(body)["generate_response"]["choices"][0]["token_ids"] == [5, 6, 7]


def test_an_answer_without_the_logprobs_is_a_protocol_error() -> None:
    lp = StreamLogprobs("policy")
    [event, *_] = events("generate-chat-stream.sse")
    assert lp.request(event) is not None
    with pytest.raises(UpstreamProtocolError) as info:
        lp.read(b'{"choices":[{"logprobs":null}]}')
    assert info.value.reason == "missing_logprobs"
    assert lp.request(event) is not None
    with pytest.raises(UpstreamProtocolError) as info:
        lp.read(b"not json")
    assert info.value.reason == "malformed_json"
    with pytest.raises(UpstreamProtocolError) as info:
        lp.request(b"{")
    assert info.value.reason == "malformed_json"
