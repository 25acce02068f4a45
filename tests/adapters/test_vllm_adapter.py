"""VLLMAdapter: request planning and non-streamed extraction, against vLLM 0.32's real answers."""

from __future__ import annotations

import copy
import json
from array import array
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.adapters.vllm import (
    CaptureExtractionError,
    ForwardPlan,
    UpstreamProtocolError,
    VLLMAdapter,
    parse_error_body,
)
from capture_proxy.adapters.vllm import _adapter as vllm_module
from capture_proxy.adapters.vllm._answer import read_answer
from capture_proxy.adapters.vllm._ids import decode_prompt
from tests.support import FIXTURES

FIXTURES = next(
    p
    for p in (
        FIXTURES / "vllm-0.32.0",
        Path("/work/shared/fixtures/vllm-0.32.0"),
    )
    if p.is_dir()
)
#: The request keys the fixtures' requests set for capture, not as a client would.
CAPTURE_KEYS = ("return_token_ids", "logprobs", "top_logprobs", "return_tokens_as_token_ids")


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_bytes())


def client_request(name: str, **extra: Any) -> dict[str, Any]:
    """The fixture's request as OpenCode would send it: without the capture keys."""
    req: dict[str, Any] = fixture(name)
    for key in CAPTURE_KEYS:
        req.pop(key, None)
    req.update(extra)
    return req


def plan_for(**client: Any) -> ForwardPlan:
    return VLLMAdapter().plan(client_request("chat-request.json", **client))


def parse(raw: bytes | dict[str, Any], plan: ForwardPlan | None = None) -> Any:
    if isinstance(raw, dict):
        raw = orjson.dumps(raw)
    return VLLMAdapter().parse_response(raw, plan or plan_for())


CHAT = (FIXTURES / "chat-response.json").read_bytes()
TOOL = (FIXTURES / "tool-call-response.json").read_bytes()


# --- plan -------------------------------------------------------------------------------------


def test_plan_injects_token_fields_without_touching_the_callers_dict() -> None:
    req = client_request("chat-request.json")
    before = copy.deepcopy(req)
    plan = VLLMAdapter().plan(req)
    assert req == before
    sent = orjson.loads(plan.body)
    assert sent["return_token_ids"] is True
    assert sent["logprobs"] is True
    assert sent["top_logprobs"] == 0
    assert "return_tokens_as_token_ids" not in sent
    assert "stream_options" not in sent
    assert {k: v for k, v in sent.items() if k not in CAPTURE_KEYS} == before
    w = plan.wants
    assert (w.stream, w.logprobs, w.top_logprobs, w.usage, w.token_ids, w.token_id_strings) == (
        False,
        False,
        None,
        True,
        False,
        False,
    )


def test_plan_asks_for_routed_experts_from_the_start_given_unless_the_client_chose() -> None:
    req = client_request("chat-request.json")
    assert "routed_experts_prompt_start" not in orjson.loads(VLLMAdapter().plan(req).body)
    plan = VLLMAdapter().plan(req, routed_experts_prompt_start=40)
    assert orjson.loads(plan.body)["routed_experts_prompt_start"] == 40
    req["routed_experts_prompt_start"] = 7
    plan = VLLMAdapter().plan(req, routed_experts_prompt_start=40)
    assert orjson.loads(plan.body)["routed_experts_prompt_start"] == 7


def test_plan_stream_asks_for_usage_and_remembers_the_client_did_not() -> None:
    req = client_request("chat-request.json", stream=True)
    plan = VLLMAdapter().plan(req)
    assert orjson.loads(plan.body)["stream_options"] == {"include_usage": True}
    assert plan.wants.stream
    assert not plan.wants.usage
    req = client_request(
        "chat-request.json",
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": False},
    )
    plan = VLLMAdapter().plan(req)
    assert orjson.loads(plan.body)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": False,
    }
    assert plan.wants.usage


def test_plan_keeps_what_the_client_asked_for() -> None:
    plan = plan_for(
        logprobs=True, top_logprobs=3, return_token_ids=True, return_tokens_as_token_ids=True
    )
    sent = orjson.loads(plan.body)
    assert sent["top_logprobs"] == 3
    assert sent["return_tokens_as_token_ids"] is True
    w = plan.wants
    assert (w.logprobs, w.top_logprobs, w.token_ids, w.token_id_strings) == (True, 3, True, True)
    # top_logprobs without logprobs: the client gets no logprobs, so upstream computes none.
    assert orjson.loads(plan_for(logprobs=False, top_logprobs=5).body)["top_logprobs"] == 0


def test_plan_renames_reasoning_for_vllm_0_16_to_0_21() -> None:
    req = client_request("chat-request.json")
    before = copy.deepcopy(req)
    sent = orjson.loads(VLLMAdapter(reasoning_field="reasoning").plan(req).body)
    assert req == before
    assistant = sent["messages"][2]
    assert assistant["reasoning"] == "I will list them."
    assert "reasoning_content" not in assistant
    assert list(assistant) == ["role", "content", "reasoning", "tool_calls"]  # order kept
    assert sent["messages"][:2] == before["messages"][:2]
    assert sent["messages"][3] == before["messages"][3]
    default = orjson.loads(VLLMAdapter().plan(req).body)
    assert default["messages"][2]["reasoning_content"] == "I will list them."
    with pytest.raises(ValueError, match="reasoning field"):
        VLLMAdapter(reasoning_field="thinking")  # type: ignore[arg-type]


# --- parse_response: the fixtures ----------------------------------------------------------


def test_chat_fixture_extraction() -> None:
    expected = fixture("chat-response.json")
    completion, _ = parse(CHAT)
    choice = expected["choices"][0]
    assert completion.prompt_token_ids == array("i", expected["prompt_token_ids"])
    assert len(completion.prompt_token_ids) == 167
    assert completion.completion_token_ids == array("i", choice["token_ids"])
    assert completion.completion_logprobs == array(
        "f", [e["logprob"] for e in choice["logprobs"]["content"]]
    )
    assert completion.completion_logprobs.typecode == "f"
    assert completion.finish_reason == "length"
    assert completion.stop_reason is None
    assert completion.response_id == "chatcmpl-89aca9f9fed05931"
    assert completion.model == "policy"
    assert completion.message == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "\n\n\n\n\n\n",
    }
    assert completion.usage == {"prompt_tokens": 167, "completion_tokens": 6, "total_tokens": 173}
    assert completion.extras == {
        "upstream_response_id": "chatcmpl-89aca9f9fed05931",
        "system_fingerprint": "vllm-0.32.0-289ee19c",
        "stop_reason": None,
    }


def test_tool_call_fixture_extraction() -> None:
    expected = fixture("tool-call-response.json")
    completion, _ = parse(TOOL, VLLMAdapter().plan(client_request("tool-call-request.json")))
    choice = expected["choices"][0]
    assert len(completion.completion_token_ids) == 48
    assert completion.completion_token_ids == array("i", choice["token_ids"])
    assert completion.completion_logprobs == array(
        "f", [e["logprob"] for e in choice["logprobs"]["content"]]
    )
    assert completion.finish_reason == "tool_calls"
    assert completion.message == {
        "role": "assistant",
        "content": None,
        "reasoning_content": None,
        "tool_calls": choice["message"]["tool_calls"],
    }


def stripped(response: dict[str, Any], *, logprobs: bool = False) -> dict[str, Any]:
    """What the client should get: the fixture minus the token fields it did not ask for."""
    out = copy.deepcopy(response)
    for key in ("prompt_token_ids", "prompt_text", "prompt_logprobs", "kv_transfer_params"):
        del out[key]
    del out["ec_transfer_params"]
    for choice in out["choices"]:
        del choice["token_ids"]
        del choice["routed_experts"]
        if not logprobs:
            choice["logprobs"] = None
    return out


@pytest.mark.parametrize("name", ["chat-response.json", "tool-call-response.json"])
def test_client_body_lacks_token_fields_and_keeps_everything_else(name: str) -> None:
    raw = (FIXTURES / name).read_bytes()
    _, body = parse(raw)
    assert orjson.loads(body) == stripped(json.loads(raw))
    # Key order is vLLM's.
    assert list(orjson.loads(body)) == list(stripped(json.loads(raw)))


def test_client_that_asked_for_logprobs_gets_them_as_vllm_sent_them() -> None:
    _, body = parse(CHAT, plan_for(logprobs=True))
    got = orjson.loads(body)
    assert got == stripped(json.loads(CHAT), logprobs=True)
    assert got["choices"][0]["logprobs"] == json.loads(CHAT)["choices"][0]["logprobs"]


def test_client_that_asked_for_token_ids_keeps_them() -> None:
    _, body = parse(CHAT, plan_for(return_token_ids=True, logprobs=True))
    got = orjson.loads(body)
    expected = json.loads(CHAT)
    assert got["prompt_token_ids"] == expected["prompt_token_ids"]
    assert got["prompt_text"] is None
    assert got["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    assert "routed_experts" not in got["choices"][0]


def test_nothing_to_strip_relays_the_upstream_bytes_unchanged() -> None:
    response = json.loads(CHAT)
    for key in ("prompt_logprobs", "kv_transfer_params", "ec_transfer_params"):
        del response[key]
    del response["choices"][0]["routed_experts"]
    raw = json.dumps(response, indent=2).encode()
    _, body = parse(raw, plan_for(return_token_ids=True, logprobs=True))
    assert body is raw


def test_non_null_fields_the_client_asked_for_are_kept() -> None:
    response = json.loads(CHAT)
    response["kv_transfer_params"] = {"do_remote_prefill": True}
    response["prompt_logprobs"] = [None, {"94": {"logprob": -1.5}}]
    _, body = parse(response)
    got = orjson.loads(body)
    assert got["kv_transfer_params"] == {"do_remote_prefill": True}
    assert got["prompt_logprobs"] == [None, {"94": {"logprob": -1.5}}]


def test_unknown_upstream_fields_pass_through_untouched() -> None:
    response = json.loads(CHAT)
    response["new_top"] = {"nested": [1, 2.50, "x"]}
    response["choices"][0]["new_choice"] = 7
    response["choices"][0]["message"]["new_message"] = "kept"
    completion, body = parse(response)
    got = orjson.loads(body)
    assert got["new_top"] == {"nested": [1, 2.5, "x"]}
    assert got["choices"][0]["new_choice"] == 7
    assert got["choices"][0]["message"]["new_message"] == "kept"
    assert completion.completion_token_ids == array("i", [210] * 6)


def test_routed_experts_and_media_spans_go_to_extras() -> None:
    response = json.loads(CHAT)
    response["choices"][0]["routed_experts"] = "k05VTVBZAQB2AHsnZGVzY3InOiAn"
    response["choices"][0]["media_spans"] = [{"start": 3, "end": 10}]
    completion, body = parse(response)
    assert completion.extras["routed_experts"] == "k05VTVBZAQB2AHsnZGVzY3InOiAn"
    assert completion.extras["media_spans"] == [{"start": 3, "end": 10}]
    choice = orjson.loads(body)["choices"][0]
    assert "routed_experts" not in choice
    assert choice["media_spans"] == [{"start": 3, "end": 10}]


def test_old_vllm_reasoning_content_and_stop_reason() -> None:
    response = json.loads(CHAT)
    message = response["choices"][0]["message"]
    message["reasoning_content"] = message.pop("reasoning")
    message["content"] = "done"
    response["choices"][0]["stop_reason"] = 151645
    completion, _ = parse(response)
    assert completion.message["reasoning_content"] == "\n\n\n\n\n\n"
    assert completion.message["content"] == "done"
    assert completion.stop_reason == 151645
    assert completion.extras["stop_reason"] == 151645


def test_token_id_strings_fallback_when_token_ids_are_absent() -> None:
    response = json.loads(CHAT)  # its logprob tokens are "token_id:210"
    del response["choices"][0]["token_ids"]
    completion, _ = parse(response)
    assert completion.completion_token_ids == array("i", [210] * 6)


# --- parse_response: failures ------------------------------------------------------------


def extraction_error(response: dict[str, Any], reason: str) -> CaptureExtractionError:
    with pytest.raises(CaptureExtractionError) as info:
        parse(response)
    assert info.value.reason == reason
    # The client still gets the answer, stripped as usual.
    assert info.value.client_body is not None
    got = orjson.loads(info.value.client_body)
    assert got["choices"][0]["message"] == response["choices"][0]["message"]
    assert "prompt_token_ids" not in got
    return info.value


def test_missing_completion_ids_without_token_id_strings() -> None:
    response = json.loads(TOOL)  # logprob tokens are text, so there is no fallback
    del response["choices"][0]["token_ids"]
    extraction_error(response, "missing_token_ids")


def test_missing_prompt_ids() -> None:
    response = json.loads(CHAT)
    del response["prompt_token_ids"]
    assert "prompt_token_ids" in extraction_error(response, "missing_token_ids").message


@pytest.mark.parametrize(
    ("spans", "where"),
    [
        ("3-10", "a list of objects, got a string"),
        (7, "a list of objects, got a number"),
        ({"start": 3}, "a list of objects, got an object"),
        ([[3, 10]], "media_spans[0] must be an object, got an array"),
        ([{"start": 3, "end": 10}, 4], "media_spans[1] must be an object, got a number"),
    ],
)
def test_media_spans_that_are_not_a_list_of_objects_are_not_staged(spans: Any, where: str) -> None:
    for at_top in (False, True):
        response = json.loads(CHAT)
        (response if at_top else response["choices"][0])["media_spans"] = spans
        error = extraction_error(response, "invalid_media_spans")
        assert where in error.message


def test_missing_logprobs() -> None:
    response = json.loads(CHAT)
    response["choices"][0]["logprobs"] = None
    extraction_error(response, "missing_logprobs")


def test_missing_usage() -> None:
    response = json.loads(CHAT)
    del response["usage"]
    extraction_error(response, "missing_usage")


@pytest.mark.parametrize(
    ("edit", "numbers"),
    [
        (lambda r: r["usage"].update(completion_tokens=7), "completion ids 6 vs usage"),
        (
            lambda r: r["usage"].update(prompt_tokens=166),
            "prompt ids 167 vs usage.prompt_tokens 166",
        ),
        (lambda r: r["choices"][0]["logprobs"]["content"].pop(), "vs logprobs 5"),
        (lambda r: r["choices"][0]["token_ids"].pop(), "completion ids 5"),
    ],
)
def test_token_count_mismatch_names_the_numbers(edit: Any, numbers: str) -> None:
    response = json.loads(CHAT)
    edit(response)
    assert numbers in extraction_error(response, "token_count_mismatch").message


def test_multiple_choices() -> None:
    response = json.loads(CHAT)
    second = copy.deepcopy(response["choices"][0])
    second["index"] = 1
    response["choices"].append(second)
    err = extraction_error(response, "multiple_choices")
    assert err.client_body is not None
    choices = orjson.loads(err.client_body)["choices"]
    assert len(choices) == 2
    assert all("token_ids" not in c for c in choices)


def test_token_id_out_of_int32_range() -> None:
    response = json.loads(CHAT)
    response["choices"][0]["token_ids"][0] = 2**31
    extraction_error(response, "invalid_token_ids")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (CHAT[:-20], "malformed_json"),
        (b"", "malformed_json"),
        (b"[1, 2]", "malformed_json"),
        (CHAT.replace(b'"token_ids": [', b'"token_ids": ["x", '), "malformed_json"),
        (b'{"id": "x", "choices": []}', "no_choices"),
        (b'{"id": "x"}', "no_choices"),
        (b'{"error": {"message": "boom", "type": "E", "param": null, "code": 500}}', "error_body"),
        (
            CHAT.replace(b'"finish_reason": "length"', b'"finish_reason": null'),
            "missing_finish_reason",
        ),
    ],
)
def test_broken_answers_are_upstream_protocol_errors(raw: bytes, reason: str) -> None:
    with pytest.raises(UpstreamProtocolError) as info:
        parse(raw)
    assert info.value.reason == reason
    assert info.value.error_body["error"]["message"]


def test_error_body_with_200_keeps_the_upstream_message() -> None:
    raw = b'{"error": {"message": "boom", "type": "E", "param": null, "code": 500}}'
    with pytest.raises(UpstreamProtocolError) as info:
        parse(raw)
    assert info.value.error_body == orjson.loads(raw)


# --- parse_error_body --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "status"), [("error-max-tokens.json", 400), ("error-model.json", 404)]
)
def test_parse_error_body_keeps_vllm_error_bodies(name: str, status: int) -> None:
    raw = (FIXTURES / name).read_bytes()
    assert parse_error_body(raw, status) == json.loads(raw)
    assert VLLMAdapter.parse_error_body(raw, status) == json.loads(raw)


def test_parse_error_body_wraps_other_shapes() -> None:
    flat = b'{"object": "error", "message": "old", "type": "BadRequestError", "param": null, '
    flat += b'"code": 400}'
    assert parse_error_body(flat, 400) == {
        "error": {"message": "old", "type": "BadRequestError", "param": None, "code": 400}
    }
    assert parse_error_body(b'{"error": "plain"}', 500) == {
        "error": {"message": "plain", "type": "upstream_error", "param": None, "code": 500}
    }
    html = parse_error_body(b"<html>502 Bad Gateway</html>", 502)
    assert html == {
        "error": {
            "message": "upstream answered HTTP 502: <html>502 Bad Gateway</html>",
            "type": "upstream_error",
            "param": None,
            "code": 502,
        }
    }
    assert "empty body" in parse_error_body(b"", 503)["error"]["message"]
    assert len(parse_error_body(b"x" * 5000, 500)["error"]["message"]) < 1100


# --- the one-pass reader of vLLM 0.32 answers gives the generic path's results ---------------


def generic(raw: bytes, plan: ForwardPlan) -> tuple[Any, bytes]:
    """The generic read (what `parse_response` does when `read_answer` declines)."""
    top, choices = vllm_module._top_and_choices(raw)
    body = vllm_module._client_body(raw, top, choices, plan.wants)
    try:
        prompt = decode_prompt(
            "prompt_token_ids", bytes(top.get("prompt_token_ids", b"null")), None
        )
        return vllm_module._extract(top, choices, prompt, None), body
    except msgspec.DecodeError as exc:  # as parse_response maps it
        raise UpstreamProtocolError("malformed_json", str(exc)) from None


@pytest.mark.parametrize("raw", [CHAT, TOOL], ids=["chat", "tool"])
def test_fixtures_take_the_one_pass_reader_with_the_generic_results(raw: bytes) -> None:
    plan = plan_for()
    assert read_answer(raw, plan.wants) is not None
    assert parse(raw, plan) == generic(raw, plan)


def test_other_shapes_and_clients_that_asked_take_the_generic_path() -> None:
    response = json.loads(CHAT)
    response["new_top"] = 1
    assert read_answer(orjson.dumps(response), plan_for().wants) is None
    assert read_answer(CHAT, plan_for(logprobs=True).wants) is None
    assert read_answer(CHAT, plan_for(return_token_ids=True).wants) is None
    response = json.loads(CHAT)
    del response["choices"][0]["token_ids"]  # the "token_id:N" fallback reads the tokens
    assert read_answer(orjson.dumps(response), plan_for().wants) is None
    assert read_answer(CHAT[:-10], plan_for().wants) is None


@settings(max_examples=200, deadline=None)
@given(
    drop=st.sets(st.sampled_from(["service_tier", "metrics", "prompt_text", "usage", "id"])),
    non_null=st.sets(st.sampled_from(["prompt_logprobs", "kv_transfer_params", "metrics"])),
    choice_drop=st.sets(st.sampled_from(["logprobs", "stop_reason", "routed_experts", "index"])),
    logprobs_null=st.booleans(),
    content=st.text(max_size=20),
    finish=st.sampled_from(["stop", "length", None]),
)
def test_one_pass_reader_never_differs_from_the_generic_path(
    drop: set[str],
    non_null: set[str],
    choice_drop: set[str],
    logprobs_null: bool,
    content: str,
    finish: str | None,
) -> None:
    response = json.loads(CHAT)
    choice = response["choices"][0]
    choice["message"]["content"] = content
    choice["finish_reason"] = finish
    if logprobs_null:
        choice["logprobs"] = None
    for key in non_null:
        response[key] = {"x": [1, None]}
    for key in drop:
        del response[key]
    for key in choice_drop:
        del choice[key]
    raw = orjson.dumps(response)
    plan = plan_for()

    def outcome(read: Any) -> Any:
        try:
            return read()
        except (CaptureExtractionError, UpstreamProtocolError) as e:
            return type(e), e.reason

    assert outcome(lambda: parse(raw, plan)) == outcome(lambda: generic(raw, plan))


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r.update(kv_transfer_params={"prompt_token_ids": [9, 9]}),
        lambda r: r.update(prompt_token_ids=None, kv_transfer_params={"prompt_token_ids": [9]}),
        lambda r: r.update(metrics={"prompt_token_ids": [1, 2]}),
        lambda r: r.update(prompt_token_ids=[1, [2], 3]),
        lambda r: r.update(prompt_token_ids=[1, "]", 3]),
        lambda r: r.update(prompt_token_ids="\u0000prompt_token_ids"),
    ],
    ids=["nested-after", "top-null", "nested-metrics", "nested-list", "bracket-string", "spoof"],
)
def test_prompt_ids_cut_out_of_the_answer_never_change_the_outcome(edit: Any) -> None:
    response = json.loads(CHAT)
    edit(response)
    raw = orjson.dumps(response)
    plan = plan_for()

    def outcome(read: Any) -> Any:
        try:
            return read()
        except (CaptureExtractionError, UpstreamProtocolError) as e:
            return type(e), e.reason

    assert outcome(lambda: parse(raw, plan)) == outcome(lambda: generic(raw, plan))
