"""Which earlier call a new call's routed experts continue, chosen from messages before sending,
and what its record says once the tokens are known."""

from __future__ import annotations

from array import array
from typing import Any

from capture_proxy.core.experts import ExpertsIndex, ExpertsPlan, record_experts, stored_entry
from capture_proxy.testing.fake_vllm._experts import encode_experts, experts_for

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def _assistant(arguments: str, **extra: Any) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call], **extra}


def _request(*messages: dict[str, Any], tools: Any = TOOLS) -> dict[str, Any]:
    return {"model": "policy", "messages": list(messages), "tools": tools}


USER = {"role": "user", "content": "fix it"}
TOOL = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
PROMPT = array("i", range(10))
COMPLETION = array("i", range(100, 105))


def _staged(index: ExpertsIndex, request: dict[str, Any], response: dict[str, Any]) -> int:
    """Stage a call holding every position's experts; returns its end (prompt + completion)."""
    full = [*PROMPT, *COMPLETION]
    extras = {"routed_experts": encode_experts(experts_for(full))}
    added, entry = record_experts(
        index.plan(request), request, response, PROMPT, COMPLETION, extras, 0, "call-0"
    )
    assert added == {}
    assert entry is not None
    index.add(*entry)
    return len(full)


def test_a_request_continues_the_call_whose_messages_and_answer_it_replays() -> None:
    index = ExpertsIndex()
    end = _staged(index, _request(USER), _assistant('{"command": "ls"}', reasoning_content="hm"))
    # Replayed loosely: compact arguments, "" for None, reasoning dropped, another tool-call id.
    replay = _assistant('{"command":"ls"}', content="")
    replay["tool_calls"][0]["id"] = "other"
    plan = index.plan(_request(USER, replay, TOOL))
    assert plan.parent is not None
    assert plan.parent.call_id == "call-0"
    assert plan.start == end


def test_other_messages_tools_or_arguments_continue_nothing() -> None:
    index = ExpertsIndex()
    _staged(index, _request(USER), _assistant('{"command": "ls"}'))
    assert index.plan(_request(USER, _assistant('{"command": "pwd"}'), TOOL)).parent is None
    assert index.plan(_request(USER, _assistant("not json"), TOOL)).parent is None
    edited = {"role": "user", "content": "fix that"}
    assert index.plan(_request(edited, _assistant('{"command": "ls"}'), TOOL)).parent is None
    other_tools = _request(USER, _assistant('{"command": "ls"}'), TOOL, tools=None)
    assert index.plan(other_tools).parent is None
    # The request alone (a retry of the first call) does not include the answer.
    assert index.plan(_request(USER)).parent is None


def test_an_empty_index_costs_no_hashing_and_a_client_start_is_left_alone() -> None:
    index = ExpertsIndex()
    assert index.plan(_request(USER)) == ExpertsPlan()
    _staged(index, _request(USER), _assistant("{}"))
    own = {**_request(USER, _assistant("{}"), TOOL), "routed_experts_prompt_start": 3}
    assert index.plan(own) == ExpertsPlan()


def test_a_prompt_that_does_not_start_with_the_parents_tokens_is_flagged() -> None:
    index = ExpertsIndex()
    end = _staged(index, _request(USER), _assistant("{}"))
    request = _request(USER, _assistant("{}"), TOOL)
    plan = index.plan(request)
    drifted = array("i", [*PROMPT, 100, 101, 999, 103, 104, 7, 8])  # one token differs
    extras = {"routed_experts": encode_experts(experts_for(list(drifted), end))}
    added, entry = record_experts(
        plan, request, _assistant("{}"), drifted, array("i", [5]), extras, 1, "call-1"
    )
    assert added == {
        "routed_experts_prompt_start": end,
        "routed_experts_parent_call_id": "call-0",
        "routed_experts_incomplete": True,
    }
    assert entry is not None
    assert not entry[1].complete
    # A call continuing the flagged one asks for every position: it does not inherit the gap.
    index.add(*entry)
    assert index.plan(_request(USER, _assistant("{}"), TOOL, _assistant("{}"), TOOL)).start is None


def test_a_prompt_shorter_than_the_start_is_flagged() -> None:
    index = ExpertsIndex()
    _staged(index, _request(USER), _assistant("{}"))
    request = _request(USER, _assistant("{}"), TOOL)
    short = array("i", PROMPT[:4])
    extras = {"routed_experts": encode_experts(experts_for([*short, 1]))}
    added, _ = record_experts(
        index.plan(request), request, {}, short, array("i", [1]), extras, 1, "c"
    )
    assert added["routed_experts_incomplete"] is True


def test_records_whose_experts_cannot_be_counted_are_no_parents() -> None:
    full = array("i", [*PROMPT, *COMPLETION])
    request, response = _request(USER), _assistant("{}")
    assert stored_entry(request, response, full, {}, 0, "a") is None
    assert stored_entry(request, response, full, {"routed_experts": "not npy"}, 0, "a") is None
    too_many = encode_experts(experts_for([*full, 1, 2]))
    assert stored_entry(request, response, full, {"routed_experts": too_many}, 0, "a") is None
    bad_start = {"routed_experts": encode_experts([]), "routed_experts_prompt_start": "x"}
    assert stored_entry(request, response, full, bad_start, 0, "a") is None
    # Without experts in the answer, nothing is added to the record.
    plan = ExpertsPlan()
    assert record_experts(plan, request, response, PROMPT, COMPLETION, {}, 0, "a") == ({}, None)


def test_a_record_read_back_is_the_same_parent_as_when_it_was_staged() -> None:
    live, resumed = ExpertsIndex(), ExpertsIndex()
    request, response = _request(USER), _assistant("{}")
    _staged(live, request, response)
    full = array("i", [*PROMPT, *COMPLETION])
    extras = {"routed_experts": encode_experts(experts_for(list(full)))}
    entry = stored_entry(request, response, full, extras, 0, "call-0")
    assert entry is not None
    resumed.add(*entry)
    nxt = _request(USER, response, TOOL)
    assert resumed.plan(nxt).parent == live.plan(nxt).parent


def test_the_latest_of_two_identical_conversations_is_the_parent() -> None:
    index = ExpertsIndex()
    request, response = _request(USER), _assistant("{}")
    full = array("i", [*PROMPT, *COMPLETION])
    extras = {"routed_experts": encode_experts(experts_for(list(full)))}
    for seq in (3, 1):
        entry = stored_entry(request, response, full, extras, seq, f"call-{seq}")
        assert entry is not None
        index.add(*entry)
    parent = index.plan(_request(USER, response, TOOL)).parent
    assert parent is not None
    assert parent.call_id == "call-3"
