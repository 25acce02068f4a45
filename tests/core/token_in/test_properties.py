"""Properties of the bridge over random conversations (Hypothesis), renders by the fake's template.

- The bridged prompt always starts with the previous call's prompt + completion, exactly.
- The proxy's inserted tokens lie between the completion and the appended messages' tokens.
- For an append-only template (no reasoning dropped) and an answer the template renders as the
  model sampled it, the bridged prompt is the plain rendering, whether the completion ended on
  its end-of-turn token or was cut by ``length``.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.core.token_in import Bridged, Extension, Prior, assemble, divergence, match, plan
from capture_proxy.testing.fake_vllm._template import IM_END, VOCAB_SIZE, encode, tool_call_text
from tests.support.token_in import continued, render_ids, render_plan, staged_prior

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
text = st.text(alphabet='ab \n{}"é', min_size=0, max_size=12)
user = st.builds(lambda t: {"role": "user", "content": t}, text)
tool = st.builds(lambda t: {"role": "tool", "tool_call_id": "x", "content": t}, text)
appended = st.lists(st.one_of(user, tool), min_size=1, max_size=4)
history = st.lists(
    st.one_of(user, st.builds(lambda t: {"role": "assistant", "content": t}, text)),
    min_size=1,
    max_size=4,
)
system = st.one_of(st.none(), st.builds(lambda t: {"role": "system", "content": t}, text))


def _bridge(prior: Prior, request: dict[str, Any], drop: bool) -> Bridged:
    ext = match(prior, request)
    assert isinstance(ext, Extension), ext
    p = plan(request, ext)
    result = assemble(prior, p, render_plan(p, drop_past_reasoning=drop))
    assert isinstance(result, Bridged), result
    return result


@settings(max_examples=150, deadline=None)
@given(
    sys_message=system,
    earlier=history,
    completion=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=20),
    finish=st.sampled_from(["stop", "length"]),
    more=appended,
    with_tools=st.booleans(),
)
def test_the_bridged_prompt_extends_the_exact_prompt_and_completion(
    sys_message: dict[str, Any] | None,
    earlier: list[dict[str, Any]],
    completion: list[int],
    finish: str,
    more: list[dict[str, Any]],
    with_tools: bool,
) -> None:
    messages = ([sys_message] if sys_message else []) + earlier
    answer = {"role": "assistant", "content": "x"}
    base = staged_prior(messages, "", answer, tools=TOOLS if with_tools else None)
    # A completion that stopped ends on its stop token, the template's end of turn.
    completion = [*completion, IM_END] if finish == "stop" else completion
    prior = Prior(base.request, answer, base.prompt_ids, completion, finish)
    bridged = _bridge(prior, continued(prior, answer, *more), drop=True)
    exact = [*prior.prompt_ids, *prior.completion_ids]
    assert bridged.prompt_ids[: len(exact)] == exact
    for start, end, _ in bridged.bridge_spans:
        assert len(exact) <= start < end <= bridged.appended_start
    # Exactly what the spans do not cover between the completion and the appended tokens.
    covered = sum(end - start for start, end, _ in bridged.bridge_spans)
    assert covered == bridged.appended_start - len(exact)
    # The close ends every prompt's bridge: <|im_end|> is in the completion or the bridge.
    assert bridged.prompt_ids[bridged.appended_start - 1 :][:1] == encode("\n")


@settings(max_examples=150, deadline=None)
@given(
    sys_message=system,
    earlier=history,
    content=text,
    finish=st.sampled_from(["stop", "length"]),
    more=appended,
    with_tools=st.booleans(),
)
def test_an_append_only_template_bridges_to_the_plain_rendering(
    sys_message: dict[str, Any] | None,
    earlier: list[dict[str, Any]],
    content: str,
    finish: str,
    more: list[dict[str, Any]],
    with_tools: bool,
) -> None:
    messages = ([sys_message] if sys_message else []) + earlier
    answer = {"role": "assistant", "content": content}
    prior = staged_prior(
        messages,
        content,
        answer,
        finish_reason=finish,
        tools=TOOLS if with_tools else None,
        drop_past_reasoning=False,
    )
    request = continued(prior, answer, *more)
    bridged = _bridge(prior, request, drop=False)
    assert divergence(bridged.prompt_ids, render_ids(request, drop_past_reasoning=False)) is None
    (span,) = bridged.bridge_spans
    assert span[2] == ("turn_close" if finish == "stop" else "end_of_turn_added")
    assert bridged.prompt_ids[span[0] - 1 if finish == "stop" else span[0]] == IM_END


arguments = st.dictionaries(st.sampled_from(["c", "path"]), text, max_size=2).map(
    lambda d: json.dumps(d, separators=(",", ":"))
)


@settings(max_examples=100, deadline=None)
@given(
    content=text,
    calls=st.lists(st.tuples(st.sampled_from(["run", "read"]), arguments), min_size=1, max_size=3),
    finish=st.sampled_from(["stop", "length"]),
    results=st.lists(tool, min_size=1, max_size=3),
)
def test_tool_call_answers_bridge_to_the_plain_rendering_of_an_append_only_template(
    content: str, calls: list[tuple[str, str]], finish: str, results: list[dict[str, Any]]
) -> None:
    sampled = content
    for i, (name, args) in enumerate(calls):
        sampled += ("\n" if i or content else "") + tool_call_text(name, args)
    tool_calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    answer = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    prior = staged_prior(
        [{"role": "user", "content": "go"}],
        sampled,
        answer,
        finish_reason=finish,
        tools=TOOLS,
        drop_past_reasoning=False,
    )
    # The client replays the arguments re-serialized, without the call ids.
    replayed = {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [
            {"function": {"name": n, "arguments": json.dumps(json.loads(a))}} for n, a in calls
        ],
    }
    request = continued(prior, replayed, *results)
    bridged = _bridge(prior, request, drop=False)
    # The exact arguments stay; rendering the replayed message verbatim would not be the same.
    verbatim = {**request, "messages": [*request["messages"][:1], answer, *results]}
    assert divergence(bridged.prompt_ids, render_ids(verbatim, drop_past_reasoning=False)) is None
