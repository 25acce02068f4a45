"""A token-in answer shaped for the client (`adapters/vllm/_derendered.py`), from vLLM 0.32's
captured derender answers: the chat route's relay rules, and the streamed message put together."""

from __future__ import annotations

from array import array
from typing import Any

import orjson
import pytest

from capture_proxy.adapters.vllm import (
    ClientWants,
    DerenderedStream,
    Generated,
    UpstreamProtocolError,
    client_answer,
    read_derendered,
    to_completion,
)
from tests import support

TOKEN_IN = support.FIXTURES / "vllm-0.32.0" / "token-in"


def wants(**given: Any) -> ClientWants:
    values: dict[str, Any] = {
        "stream": False,
        "logprobs": False,
        "top_logprobs": None,
        "usage": True,
        "token_ids": False,
        "token_id_strings": False,
    }
    values.update(given)
    return ClientWants(**values)


def generated(n: int) -> Generated:
    return Generated(
        "generate-tokens-x",
        completion_ids=array("i", range(3, 3 + n)),
        logprobs=array("f", [-0.5] * n),
        finish_reason="stop",
        usage={"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n},
    )


def derendered(name: str) -> dict[str, Any]:
    return dict(orjson.loads((TOKEN_IN / name).read_bytes()))


def test_a_unary_answer_gets_the_chat_routes_finish_reason_and_generates_usage() -> None:
    answer = derendered("derender-tools-response.json")
    n = answer["usage"]["completion_tokens"]
    body = orjson.loads(client_answer(answer, generated(n), [1] * 7, wants()))
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"  # derender says "stop"
    # In the chat route's shape (chat-response.json): its keys in its order.
    assert list(body["usage"].items()) == [
        ("prompt_tokens", 7),
        ("total_tokens", 7 + n),
        ("completion_tokens", n),
        ("prompt_tokens_details", None),
    ]
    assert "token_ids" not in choice
    assert "routed_experts" not in choice
    for key in ("prompt_token_ids", "prompt_text", "prompt_logprobs", "kv_transfer_params"):
        assert key not in body
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "bash"


def test_logprobs_and_ids_reach_only_a_client_that_asked() -> None:
    answer = derendered("derender-chat-response.json")
    n = answer["usage"]["completion_tokens"]
    plain = orjson.loads(client_answer(answer, generated(n), [1] * 7, wants()))
    assert plain["choices"][0]["logprobs"] is None
    asked = orjson.loads(
        client_answer(answer, generated(n), [1] * 7, wants(logprobs=True, token_ids=True))
    )
    assert asked["choices"][0]["logprobs"] == answer["choices"][0]["logprobs"]
    assert asked["prompt_token_ids"] == [1] * 7
    assert asked["choices"][0]["token_ids"] == list(range(3, 3 + n))


def _chunks(name: str) -> list[dict[str, Any]]:
    return [r["chunk"] for r in derendered(name)["responses"]]


def test_a_stream_is_relayed_and_its_message_put_together() -> None:
    stream = DerenderedStream(wants(stream=True, usage=False), [1] * 7)
    pieces = [stream.feed(c) for c in _chunks("derender-tools-stream.json")]
    sent = [orjson.loads(p[6:]) for p in pieces if p is not None]
    assert all(p.startswith(b"data: {") and p.endswith(b"\n\n") for p in pieces if p)
    assert all("usage" not in s for s in sent)  # the client did not ask for usage
    message = stream.message()
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "bash"
    assert orjson.loads(call["function"]["arguments"]) == {"command": "ls -la"}
    assert call["id"].startswith("chatcmpl-tool-")
    completion = to_completion(
        generated(3), array("i", [1] * 7), {"choices": [{"message": message}]}
    )
    assert completion.message["tool_calls"] == [call]


def test_a_client_that_asked_for_usage_gets_the_prompt_the_call_sent() -> None:
    stream = DerenderedStream(wants(stream=True, usage=True, token_ids=True), [1] * 7)
    sent = [stream.feed(c) for c in _chunks("derender-chat-stream.json")]
    first = orjson.loads(sent[0][6:])  # type: ignore[index]
    assert first["prompt_token_ids"] == [1] * 7
    usage = [orjson.loads(s[6:])["usage"] for s in sent if s and b'"usage":{' in s]
    assert usage
    assert all(u["prompt_tokens"] == 7 for u in usage)
    assert stream.message()["reasoning"]


def test_a_unary_answer_read_once_relays_derender_s_values_as_they_came() -> None:
    raw = (TOKEN_IN / "derender-chat-response.json").read_bytes()
    answer = read_derendered(raw)
    n = orjson.loads(raw)["usage"]["completion_tokens"]
    asked = wants(logprobs=True, token_ids=True)
    body = client_answer(answer, generated(n), [1] * 7, asked, ids_json=b"[1,1,1,1,1,1,1]")
    # The per-token logprobs are spliced, never decoded: the same JSON as the dict's.
    assert orjson.loads(body) == orjson.loads(
        client_answer(derendered("derender-chat-response.json"), generated(n), [1] * 7, asked)
    )
    assert answer.for_record() == {"choices": [{"message": answer.messages[0]}]}
    assert answer.messages[0]["reasoning"] == "\n\n\n\n\n\n"


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"[1, 2]", "Expected `object`"),
        (b'{"choices": {"message": {}}}', "Expected `array`"),
        (b'{"choices": [{"message": "text"}]}', "Expected `object`"),
        (b'{"choices": [', "truncated"),
    ],
)
def test_a_derender_answer_that_is_not_a_chat_completion_is_a_protocol_error(
    raw: bytes, why: str
) -> None:
    with pytest.raises(UpstreamProtocolError) as err:
        read_derendered(raw)
    assert err.value.reason == "malformed_json"
    assert why in err.value.message


@pytest.mark.parametrize(
    ("derendered_id", "client_id"),
    [
        ("887cf180523b942b", "chatcmpl-tool-887cf180523b942b"),  # vLLM 0.32's unary derender
        ("chatcmpl-tool-887cf180523b942b", "chatcmpl-tool-887cf180523b942b"),
        ("functions.bash:0", "functions.bash:0"),  # a Kimi-style id, kept
        ("887CF180523B942B", "887CF180523B942B"),  # not vLLM's random_uuid(): kept
    ],
)
def test_a_unary_tool_call_id_gets_the_chat_route_s_form(
    derendered_id: str, client_id: str
) -> None:
    answer = derendered("derender-tools-response.json")
    answer["choices"][0]["message"]["tool_calls"][0]["id"] = derendered_id
    read = read_derendered(orjson.dumps(answer))
    n = len(answer["choices"][0]["token_ids"] or []) or 3
    body = orjson.loads(client_answer(read, generated(n), [1] * 7, wants()))
    assert body["choices"][0]["message"]["tool_calls"][0]["id"] == client_id
    assert read.for_record()["choices"][0]["message"]["tool_calls"][0]["id"] == client_id


def test_logprobs_keep_only_the_top_entries_the_client_asked_for() -> None:
    # Derender resolves every alternative generate sampled: with `top_logprobs` 0 that is the
    # sampled token's own, which the chat route leaves out.
    answer = derendered("derender-chat-response.json")
    entry = {"token": "a", "logprob": -0.5, "bytes": [97]}
    answer["choices"][0]["logprobs"] = {"content": [{**entry, "top_logprobs": [entry]}] * 2}
    gen = generated(2)
    gen.top_logprobs = [[(3, -0.5)], [(4, -0.5)]]
    read = read_derendered(orjson.dumps(answer)).with_chat_logprobs(gen, wants(logprobs=True))
    body = orjson.loads(client_answer(read, gen, [1] * 7, wants(logprobs=True)))
    assert [e["top_logprobs"] for e in body["choices"][0]["logprobs"]["content"]] == [[], []]
    as_ids = wants(logprobs=True, top_logprobs=1, token_id_strings=True)
    read = read_derendered(orjson.dumps(answer)).with_chat_logprobs(gen, as_ids)
    content = orjson.loads(client_answer(read, gen, [1] * 7, as_ids))["choices"][0]["logprobs"]
    assert content["content"] == [
        {
            "token": f"token_id:{i}",
            "logprob": -0.5,
            "bytes": [97],
            "top_logprobs": [
                {"token": f"token_id:{i}", "logprob": -0.5, "bytes": list(b"token_id:%d" % i)}
            ],
        }
        for i in (3, 4)
    ]
