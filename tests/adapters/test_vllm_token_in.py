"""The token-in parsers (`adapters/vllm/_render.py`, `_generate.py`, `_derender.py`) against
vLLM 0.32's captured answers."""

from __future__ import annotations

import dataclasses
import json
from array import array
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture_proxy.adapters.vllm import (
    DerenderCoalescer,
    GenerateEvent,
    GenerateStream,
    UpstreamProtocolError,
    derender_body,
    merge_chunks,
    pair_anchor,
    read_anchored,
    read_generate,
    read_render,
    read_render_pair,
    to_completion,
    usage_chunk,
)
from capture_proxy.adapters.vllm._render import compact_sampling
from tests import support

TOKEN_IN = support.FIXTURES / "vllm-0.32.0" / "token-in"


def raw(name: str) -> bytes:
    return (TOKEN_IN / name).read_bytes()


def test_a_render_answer_gives_the_prompt_and_a_generate_body_with_ids_replaced() -> None:
    rendered = read_render(raw("render-chat-response.json"))
    real = orjson.loads(raw("render-chat-response.json"))
    assert rendered.prompt_ids == real["token_ids"]
    assert rendered.sampling_params["logprobs"] == 1
    sent = orjson.loads(rendered.generate_body())
    assert sent == as_generate_reads(orjson.loads(raw("generate-chat-request.json")))
    replaced = orjson.loads(rendered.generate_body([1, 2, 3], stream=True))
    assert replaced["token_ids"] == [1, 2, 3]
    assert replaced["stream_options"] == {"include_usage": True}
    assert {
        k: v for k, v in replaced.items() if k not in ("token_ids", "stream", "stream_options")
    } == {
        k: v
        for k, v in as_generate_reads(real).items()
        if k not in ("token_ids", "stream", "stream_options")
    }


#: vLLM 0.32's ``GenerateRequest`` fields whose value is their default (every other optional
#: field defaults to null).
GENERATE_DEFAULTS: dict[str, Any] = {"priority": 0, "output_mode": "tokens", "stream": False}


def as_generate_reads(body: dict[str, Any]) -> dict[str, Any]:
    """A generate request without what vLLM reads the same when it is left out: null or default
    fields, sampling parameters at ``SamplingParams``' defaults (`compact_sampling`), and
    render's reasoning fields without a structured output."""
    out = {
        k: v
        for k, v in body.items()
        if v is not None and not (k in GENERATE_DEFAULTS and v == GENERATE_DEFAULTS[k])
    }
    if isinstance(out.get("sampling_params"), dict):
        out["sampling_params"] = compact_sampling(out["sampling_params"])
        if out["sampling_params"].get("structured_outputs") is None:
            # Read by vLLM 0.32's engine only for a structured output's grammar (a true
            # `reasoning_ended` stays: the fake's scripted model reads it).
            if out.get("reasoning_ended") is not True:
                out.pop("reasoning_ended", None)
            out.pop("reasoning_parser_kwargs", None)
    return out


def test_generate_gets_the_sampling_params_without_the_ones_at_vllm_s_defaults() -> None:
    params = {
        "temperature": 1.0,
        "presence_penalty": 0.0,
        "stop": [],
        "stop_token_ids": None,
        "bad_words": [],
        "output_kind": 2,
        "n": 1,
        "top_k": 0,
        # Not defaults: kept.
        "max_tokens": 16,  # generate tells a limit it got from none (it fills in the room)
        "top_p": 0.9,
        "min_tokens": False,  # not the int 0: sent as it is
        "stop_token_ids_extra": [],
        "skip_special_tokens": False,
        "logprobs": 0,
        "skip_reading_prefix_cache": False,  # what vLLM sets without prompt logprobs: left out
    }
    kept = {
        "max_tokens": 16,
        "top_p": 0.9,
        "min_tokens": False,
        "stop_token_ids_extra": [],
        "skip_special_tokens": False,
        "logprobs": 0,
    }
    assert compact_sampling(params) == kept
    # With prompt logprobs vLLM would skip the prefix cache on its own: said, it stays.
    asked = {**params, "prompt_logprobs": 1}
    assert compact_sampling(asked) == {
        **kept,
        "prompt_logprobs": 1,
        "skip_reading_prefix_cache": False,
    }
    assert compact_sampling({**params, "skip_reading_prefix_cache": True}) == {
        **kept,
        "skip_reading_prefix_cache": True,
    }


def test_generate_gets_render_s_reasoning_fields_only_with_a_structured_output() -> None:
    real = orjson.loads(raw("render-chat-response.json"))
    assert real["reasoning_parser_kwargs"] is not None  # the server has a reasoning parser
    sent = orjson.loads(read_render(raw("render-chat-response.json")).generate_body())
    assert "reasoning_ended" not in sent
    assert "reasoning_parser_kwargs" not in sent
    ended = {**real, "reasoning_ended": True}  # thinking off: kept (the fake reads it)
    sent = orjson.loads(read_render(orjson.dumps(ended)).generate_body())
    assert sent["reasoning_ended"] is True
    assert "reasoning_parser_kwargs" not in sent
    structured = {**real, "sampling_params": {**real["sampling_params"], **_REGEX}}
    sent = orjson.loads(read_render(orjson.dumps(structured)).generate_body())
    assert sent["reasoning_ended"] == real["reasoning_ended"]
    assert sent["reasoning_parser_kwargs"] == real["reasoning_parser_kwargs"]


_REGEX = {"structured_outputs": {"regex": "[a-z]+"}}


def test_a_unary_generate_answer_reads_ids_logprobs_tops_and_spans() -> None:
    got = read_generate(raw("generate-chat-response.json"))
    real = orjson.loads(raw("generate-chat-response.json"))["choices"][0]
    assert list(got.completion_ids) == real["token_ids"]
    assert got.logprobs.typecode == "f"
    assert list(got.logprobs) == list(
        array("f", [e["logprob"] for e in real["logprobs"]["content"]])
    )
    assert got.top_logprobs is not None
    assert len(got.top_logprobs) == len(real["token_ids"])
    assert (got.finish_reason, got.weight_spans) == ("length", (("default", 0, 6),))
    assert got.usage == {"prompt_tokens": 24, "completion_tokens": 6, "total_tokens": 30}
    tools = read_generate(raw("generate-tools-response.json"))
    assert (len(tools.logprobs), tools.top_logprobs, tools.finish_reason) == (0, None, "stop")


@given(st.lists(st.integers(min_value=1, max_value=400), max_size=30))
def test_a_streamed_generate_split_anywhere_reads_as_the_unary_one(cuts: list[int]) -> None:
    data = raw("generate-weight-update-stream.sse")
    stream = GenerateStream()
    pos, events = 0, []
    for cut in cuts:
        events += stream.feed(data[pos : pos + cut])
        pos += cut
    events += stream.feed(data[pos:])
    got = stream.finish()
    assert sum(e.new_ids for e in events) == len(got.completion_ids) == 48
    assert got.weight_spans == (("step-1", 0, 4), ("step-2", 4, 48))


def test_a_stream_without_done_or_with_garbage_is_a_protocol_error() -> None:
    data = raw("generate-chat-stream.sse")
    cut = GenerateStream()
    cut.feed(data[: data.rindex(b"data: [DONE]")])
    with pytest.raises(UpstreamProtocolError, match="missing_done"):
        cut.finish()
    with pytest.raises(UpstreamProtocolError, match="malformed_json"):
        GenerateStream().feed(b'data: {"request_id": 3}\n\n')
    error = b'data: {"error": {"message": "boom", "type": "x", "param": null, "code": 500}}\n\n'
    with pytest.raises(UpstreamProtocolError) as info:
        GenerateStream().feed(error)
    assert info.value.error_body["error"]["message"] == "boom"


def test_invalid_render_and_generate_answers_are_protocol_errors() -> None:
    with pytest.raises(UpstreamProtocolError, match="no_token_ids"):
        read_render(b'{"token_ids": "x"}')
    with pytest.raises(UpstreamProtocolError, match="malformed_json"):
        read_render(b"{")
    with pytest.raises(UpstreamProtocolError, match="malformed_json"):
        read_generate(b'{"request_id": "a"}')
    with pytest.raises(UpstreamProtocolError, match="no_choices"):
        read_generate(b'{"request_id": "a", "choices": []}')


def test_the_coalescer_sends_the_first_event_alone_then_what_waited() -> None:
    c = DerenderCoalescer(min_interval=0.05)
    events = [
        GenerateEvent(
            orjson.dumps(
                {
                    "request_id": "r",
                    "usage": None,
                    "choices": [{"token_ids": [i], "logprobs": None}],
                }
            ),
            1,
            True,
        )
        for i in range(5)
    ]
    c.add(events[0])
    assert c.take(10.0) == events[0].data
    for e in events[1:4]:
        c.add(e)
    assert c.take(10.01) is None  # a call is in flight
    c.finished()
    assert c.take(10.02) is None  # too soon after the last call started
    assert c.due() == pytest.approx(10.05)
    merged = c.take(10.05)
    assert merged is not None
    assert orjson.loads(merged)["choices"][0]["token_ids"] == [1, 2, 3]
    assert merged == merge_chunks(events[1:4])
    c.finished()
    usage = GenerateEvent(b'{"request_id":"r","usage":{"prompt_tokens":1},"choices":[]}', 0, False)
    c.add(events[4])
    c.add(usage)
    c.close()  # the stream ended: no more waiting
    last = c.take(10.06)
    assert last is not None
    assert last == events[4].data
    c.finished()
    assert c.take(10.06) == usage.data
    assert c.calls == 4


def test_a_derendered_generation_converts_to_the_staged_completion() -> None:
    request = orjson.loads(raw("derender-tools-request.json"))
    generated = read_generate(orjson.dumps(request["generate_response"]))
    body = orjson.loads(
        derender_body(
            orjson.dumps(request["generate_response"]),
            request["prompt_token_ids"],
            request["chat_request"],
        )
    )
    assert body == request
    answer = orjson.loads(raw("derender-tools-response.json"))
    prompt = array("i", request["prompt_token_ids"])
    done = to_completion(generated, prompt, answer)
    assert done.completion_token_ids == array(
        "i", request["generate_response"]["choices"][0]["token_ids"]
    )
    assert done.message["tool_calls"][0]["function"]["name"] == "bash"
    assert done.finish_reason == "stop"
    assert done.usage["prompt_tokens"] == len(prompt)


def test_a_generate_body_keeps_the_render_answer_s_fields_and_replaces_sampling_when_asked() -> (
    None
):
    rendered = read_render(raw("render-chat-response.json"))
    real = orjson.loads(raw("render-chat-response.json"))
    params = {**real["sampling_params"], "max_tokens": 2}
    body = orjson.loads(rendered.generate_body([7], sampling_params=params))
    assert body == as_generate_reads({**real, "token_ids": [7], "sampling_params": params})


def _suffix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]


@given(
    st.lists(st.integers(0, 300), max_size=40),
    st.lists(st.integers(0, 300), max_size=6),
    st.lists(st.integers(0, 300), max_size=6),
    st.lists(st.integers(0, 300), max_size=40),
    st.booleans(),
)
def test_a_render_pair_s_tails_have_the_common_suffix_and_sameness_of_the_whole_lists(
    head: list[int], one: list[int], two: list[int], tail: list[int], spaced: bool
) -> None:
    a, b = [*head, *one, *tail], [*head, *two, *tail]

    def answer(ids: list[int]) -> bytes:
        # orjson writes no spaces; Python's json (vLLM's servers may) writes ", ".
        text = json.dumps(ids) if spaced else orjson.dumps(ids).decode()
        return b'{"request_id": "r", "token_ids": ' + text.encode() + b', "features": null}'

    (x, y), features = read_render_pair(answer(a), answer(b))
    assert x == a[len(a) - len(x) :]
    assert y == b[len(b) - len(y) :]
    assert _suffix(x, y) == _suffix(a, b)
    assert (x == y) == (a == b)
    assert features == (None, None)


def test_a_render_pair_with_ids_that_are_not_ints_is_a_protocol_error() -> None:
    good = b'{"token_ids": [1, 2, 3]}'
    for bad in (b'{"token_ids": [1, 2, "x"]}', b'{"token_ids": "123"}', b"{}"):
        with pytest.raises(UpstreamProtocolError, match="no_token_ids"):
            read_render_pair(good, bad)
    with pytest.raises(UpstreamProtocolError, match="malformed_json"):
        read_render_pair(good, b'{"token_ids": [1, 2')


@given(
    st.lists(st.integers(0, 300), max_size=30),
    st.lists(st.integers(0, 300), max_size=8),
    st.lists(st.integers(0, 300), max_size=8),
    st.booleans(),
    st.booleans(),
)
def test_a_render_read_against_known_ids_gives_the_ids_of_a_whole_decode(
    head: list[int], one: list[int], two: list[int], spaced: bool, known_spaced: bool
) -> None:
    answer_ids, known_ids = [*head, *one], [*head, *two]

    def spelled(ids: list[int], spaces: bool) -> bytes:
        return (json.dumps(ids) if spaces else orjson.dumps(ids).decode()).encode()

    answer = b'{"request_id": "r", "token_ids": ' + spelled(answer_ids, spaced) + b"}"
    known = (spelled(known_ids, known_spaced), known_ids)
    rendered = read_render(answer, known=known)
    assert rendered.prompt_ids == read_render(answer).prompt_ids == answer_ids
    assert rendered.ids_json == spelled(answer_ids, spaced)


def test_a_render_read_against_known_ids_still_checks_the_ids_it_decodes() -> None:
    known = (b"[1,2,3]", [1, 2, 3])
    for bad in (b'{"token_ids": [1, 2, "x"]}', b'{"token_ids": [1,2,3.5]}'):
        with pytest.raises(UpstreamProtocolError, match="no_token_ids"):
            read_render(bad, known=known)


def _compact_answer(ids: list[int], rest: bytes = b',"features":null}') -> bytes:
    """A render answer as vLLM writes it (compact, the request id first): the reads that cut
    out the ids a known list spells (`_without_known`) apply to it."""
    return b'{"request_id":"chatcmpl-9f","token_ids":' + orjson.dumps(ids) + rest


_RESTS = st.sampled_from(
    [
        b',"features":null}',
        b',"features":null,"sampling_params":{"max_tokens":7,"stop":[","]}}',
        b"}",
    ]
)


@given(
    st.lists(st.integers(0, 300), max_size=40),
    st.lists(st.integers(0, 300), max_size=6),
    st.lists(st.integers(0, 300), max_size=6),
    st.lists(st.integers(0, 300), max_size=20),
    st.one_of(st.none(), st.lists(st.integers(0, 300), max_size=50)),
    _RESTS,
)
def test_a_compact_render_pair_read_against_known_ids_reads_as_a_whole_parse(
    head: list[int],
    one: list[int],
    two: list[int],
    tail: list[int],
    known: list[int] | None,
    rest: bytes,
) -> None:
    # `known` (the previous call's prompt) shares any prefix with the answers' ids, or none.
    a, b = [*head, *one, *tail], [*head, *two, *tail]
    first, second = _compact_answer(a, rest), _compact_answer(b, rest)
    whole = read_render_pair(_spaced(first), _spaced(second))  # spaced: parsed whole
    for known_json in (None, orjson.dumps(known) if known is not None else None):
        assert read_render_pair(first, second, known_json) == whole
    (x, y), _ = whole
    assert _suffix(x, y) == _suffix(a, b)
    assert (x == y) == (a == b)


@given(
    st.lists(st.integers(0, 300), max_size=30),
    st.lists(st.integers(0, 300), max_size=8),
    st.lists(st.integers(0, 300), max_size=8),
    _RESTS,
)
def test_a_compact_render_read_against_known_ids_reads_as_a_whole_parse(
    head: list[int], one: list[int], two: list[int], rest: bytes
) -> None:
    answer_ids, known_ids = [*head, *one], [*head, *two]
    answer = _compact_answer(answer_ids, rest)
    whole = read_render(answer)
    rendered = read_render(answer, known=(orjson.dumps(known_ids), known_ids))
    assert rendered.prompt_ids == whole.prompt_ids == answer_ids
    assert rendered.ids_json == whole.ids_json == orjson.dumps(answer_ids)
    assert rendered.sampling_params == whole.sampling_params
    assert rendered.features == whole.features
    assert dict(rendered.rest) == dict(whole.rest)
    assert dict(rendered.unary) == dict(whole.unary)
    assert rendered.generate_body() == whole.generate_body()
    # The ids read as known's are the same ids: where the two lists first differ is after them.
    shared = next(
        (i for i, (p, q) in enumerate(zip(answer_ids, known_ids, strict=False)) if p != q),
        min(len(answer_ids), len(known_ids)),
    )
    assert rendered.known_prefix <= shared


_START = b'{"request_id":"r","token_ids":[1,2,3,'


@pytest.mark.parametrize(
    "bad",
    [
        _START + b'"x"]}',  # not an int after the known ones
        _START + b"4",  # cut short
        _START + b"4]",  # no object's end
        _START + b"4],}",  # a trailing comma
        _START + b'4],"features":nul}',  # garbled after the list
    ],
)
def test_a_compact_render_read_against_known_ids_fails_as_a_whole_parse(bad: bytes) -> None:
    known_ids = [1, 2, 3, 4]
    known = (orjson.dumps(known_ids), known_ids)
    good = _compact_answer(known_ids)
    # The same error, message included, as the whole answer's parse.
    assert _failure(read_render, bad, known=known) == _failure(read_render, bad)
    whole_pair = _failure(read_render_pair, _spaced(good), bad)
    assert _failure(read_render_pair, good, bad, known[0]) == whole_pair
    assert _failure(read_render_pair, good, bad) == whole_pair


def _failure(read: Callable[..., object], *args: Any, **kwargs: Any) -> tuple[str, str]:
    with pytest.raises(UpstreamProtocolError) as info:
        read(*args, **kwargs)
    return info.value.reason, info.value.message


def test_a_pair_s_shared_ids_that_are_not_ints_are_not_cut_out() -> None:
    # The first answer's list is only parsed as JSON: the second's bytes it shares with it are
    # cut out only when they are digits and commas (a string may hold a comma).
    first = b'{"request_id":"r","token_ids":["a,b",1,2,3]}'
    second = b'{"request_id":"r","token_ids":["a,b",1,2,4]}'
    assert read_render_pair(first, second) == read_render_pair(_spaced(first), _spaced(second))


def _spaced(answer: bytes) -> bytes:
    """The same answer with a space after its first key: read by a whole parse."""
    return answer.replace(b'{"request_id":', b'{"request_id": ', 1)


@pytest.mark.parametrize("name", ["generate-tools-stream.sse", "generate-chat-stream.sse"])
@given(st.data())
def test_merged_stream_events_join_ids_and_logprobs_as_the_decoded_events_say(
    name: str, data: st.DataObject
) -> None:
    events = GenerateStream().feed(raw(name))
    start = data.draw(st.integers(0, len(events) - 2))
    end = data.draw(st.integers(start + 2, len(events)))
    chosen = events[start:end]
    merged = orjson.loads(merge_chunks(chosen))
    # Held to what the events say one by one, not to a second copy of the merge.
    decoded = [orjson.loads(e.data) for e in chosen]
    firsts = [d["choices"][0] for d in decoded if d.get("choices")]
    [choice] = merged["choices"]
    assert choice["token_ids"] == [t for c in firsts for t in c.get("token_ids") or ()]
    entries = [e for c in firsts for e in (c.get("logprobs") or {}).get("content") or ()]
    assert (choice["logprobs"] or {}).get("content", []) == entries
    assert choice["finish_reason"] == firsts[-1].get("finish_reason")
    usages = [d["usage"] for d in decoded if d.get("usage")]
    assert merged["usage"] == (usages[-1] if usages else None)
    for key in decoded[-1].keys() - {"choices", "usage"}:
        assert merged[key] == decoded[-1][key]


@pytest.mark.parametrize(
    "name",
    ["generate-tools-stream.sse", "generate-chat-stream.sse", "generate-weight-update-stream.sse"],
)
@given(st.data())
def test_merging_from_the_decoded_ids_gives_the_bytes_of_the_whole_merge(
    name: str, data: st.DataObject
) -> None:
    events = GenerateStream().feed(raw(name))
    start = data.draw(st.integers(0, len(events) - 2))
    end = data.draw(st.integers(start + 2, len(events)))
    chosen = events[start:end]
    # Without the decoded ids every event is decoded again: the merge as it was written first.
    whole = [dataclasses.replace(e, ids=None) for e in chosen]
    assert merge_chunks(chosen) == merge_chunks(whole)


def test_only_events_without_logprobs_or_usage_keep_their_decoded_ids() -> None:
    tools = GenerateStream().feed(raw("generate-tools-stream.sse"))
    assert tools[0].ids == orjson.loads(tools[0].data)["choices"][0]["token_ids"]
    assert tools[-1].ids is None  # the usage event
    chat = GenerateStream().feed(raw("generate-chat-stream.sse"))
    with_logprobs = [e for e in chat if b'"logprobs":{' in e.data]
    assert with_logprobs
    assert all(e.ids is None for e in with_logprobs)


@given(
    st.lists(st.integers(0, 300), max_size=30),
    st.integers(0, 300),
    st.integers(0, 300),
    st.lists(st.integers(0, 300), min_size=1, max_size=10),
    st.lists(st.integers(0, 300), max_size=10),
    _RESTS,
)
def test_a_pair_that_differs_in_one_id_anchors_single_renders_at_it(
    head: list[int], one: int, two: int, tail: list[int], other: list[int], rest: bytes
) -> None:
    first, second = _compact_answer([*head, one, *tail], rest), _compact_answer([*head, two, *tail])
    anchor = pair_anchor(first, second)
    if one == two:
        assert anchor is None
        return
    # Everything up to and including the id that differs, with its comma.
    assert anchor == orjson.dumps([*head, one])[:-1] + b","
    # A single render of the same start reads as the ids after it; any other start does not.
    assert read_anchored(_compact_answer([*head, one, *other], rest), anchor) == (
        (other, None) if other else None
    )
    assert read_anchored(_compact_answer([*head, two, *other], rest), anchor) is None
    assert read_anchored(_spaced(_compact_answer([*head, one, *other], rest)), anchor) is None


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ([1, 2, 3], [1, 2, 3]),  # the same: where the content is cannot be seen
        ([1, 65, 3], [1, 66, 4]),  # two ids differ
        ([1, 65, 3], [1, 66, 3, 4]),  # and the lengths
        ([1, 2, 65], [1, 2, 66]),  # nothing after the content
        ([1, 65, 3], [1, 6, 5, 3]),  # one id against two
    ],
)
def test_a_pair_that_does_not_differ_in_exactly_one_id_has_no_anchor(
    first: list[int], second: list[int]
) -> None:
    assert pair_anchor(_compact_answer(first), _compact_answer(second)) is None
    assert pair_anchor(_spaced(_compact_answer([1, 65, 3])), _compact_answer([1, 66, 3])) is None


def test_a_single_render_read_against_an_anchor_still_checks_what_it_decodes() -> None:
    anchor = b"[1,2,65,"
    for bad in (
        b'{"request_id":"r","token_ids":[1,2,65,"x"]}',
        b'{"request_id":"r","token_ids":[1,2,65,3.5]}',
    ):
        with pytest.raises(UpstreamProtocolError, match="no_token_ids"):
            read_anchored(bad, anchor)
    with pytest.raises(UpstreamProtocolError, match="malformed_json"):
        read_anchored(b'{"request_id":"r","token_ids":[1,2,65,7', anchor)


@pytest.mark.parametrize("name", ["chat", "tools"])
def test_the_usage_chunk_is_derender_s_without_a_call(name: str) -> None:
    # vLLM's own streamed derender: its last answer is the usage chunk, from the usage event.
    stream = orjson.loads(raw(f"derender-{name}-stream.json"))
    sse = raw(f"generate-{name}-stream.sse")
    events = [line[6:] for line in sse.split(b"\n") if line.startswith(b"data: {")]
    previous, real = stream["responses"][-2]["chunk"], stream["responses"][-1]["chunk"]
    assert real["choices"] == []
    assert usage_chunk(previous, events[-1]) == real


def test_a_usage_event_goes_without_a_call_and_anything_else_through_derender() -> None:
    c = DerenderCoalescer(min_interval=0.05)
    token = GenerateEvent(b'{"request_id":"r","choices":[{"token_ids":[1]}]}', 1, True)
    usage = GenerateEvent(b'{"request_id":"r","usage":{"prompt_tokens":1},"choices":[]}', 0, False)
    c.add(token)
    c.add(usage)
    assert c.take_usage(10.0) is None  # a token event is next
    assert c.take(10.0) == token.data
    assert c.take_usage(10.01) is None  # a call is in flight
    c.finished()
    assert c.take_usage(10.02) is None  # too soon, the stream not ended
    c.close()
    assert c.take_usage(10.02) == usage.data
    assert (c.calls, c.pending) == (1, False)
    # A usage event that is not one (no counts) is derender's to answer.
    assert usage_chunk({"id": "x"}, usage.data) is None
    assert usage_chunk({"id": "x"}, b"not json") is None


def test_a_render_answer_that_leaves_out_a_limit_of_16_gets_it_said_to_generate() -> None:
    # vLLM's own answer for `max_tokens: 16`: no `max_tokens` (SamplingParams' default).
    rendered = read_render(raw("render-max-tokens-16-response.json"))
    assert "max_tokens" not in rendered.sampling_params
    assert rendered.resolved_sampling == {**rendered.sampling_params, "max_tokens": 16}
    body = orjson.loads(rendered.generate_body())
    assert body["sampling_params"] == compact_sampling(rendered.resolved_sampling)
    assert body["sampling_params"]["max_tokens"] == 16
    # An answer that says its limit is sent back as it came.
    said = read_render(raw("render-chat-response.json"))
    assert said.resolved_sampling is said.sampling_params
    sent = orjson.loads(said.generate_body())["sampling_params"]
    assert sent == compact_sampling(said.sampling_params)
