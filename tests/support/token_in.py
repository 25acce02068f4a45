"""Token-in bridging driven by the fake vLLM's pure chat template, without HTTP.

`render_ids` renders a chat body as the fake's render route would (its Qwen3-style template, by
default dropping reasoning before the last user message: not append-only), and `render_plan`
answers a `BridgePlan`'s four render requests with it. `staged_prior` builds the `Prior` a real
call would leave: the prompt rendered from its request, a completion sampled as given text.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from aiohttp.test_utils import TestServer

from capture_proxy.core.token_in import BridgePlan, BridgeRenders, Prior, media_items, suffix_media
from capture_proxy.testing.fake_vllm import FakeVLLM
from capture_proxy.testing.fake_vllm._features import render_features
from capture_proxy.testing.fake_vllm._template import IM_END, encode, render_chat, tool_call_text
from capture_proxy.upstream.http import HTTPUpstream
from tests.support.proxy_harness import Proxy

MODEL = "policy"


def render_ids(body: Mapping[str, Any], *, drop_past_reasoning: bool = True) -> list[int]:
    """The prompt ids the fake's template gives a chat body."""
    text = render_chat(
        body["messages"],
        body.get("tools"),
        add_generation_prompt=body.get("add_generation_prompt", True) is not False,
        drop_past_reasoning=drop_past_reasoning,
    )
    return encode(text)


def render_plan(plan: BridgePlan, *, drop_past_reasoning: bool = True) -> BridgeRenders:
    """Answer a plan's render requests with the fake's template."""

    def ids(body: Mapping[str, Any]) -> list[int]:
        return render_ids(body, drop_past_reasoning=drop_past_reasoning)

    suffix = (ids(plan.suffix[0]), ids(plan.suffix[1]))
    features = tuple(features_of(b, i) for b, i in zip(plan.suffix, suffix, strict=True))
    return BridgeRenders(
        close=(ids(plan.close[0]), ids(plan.close[1])),
        suffix=suffix,
        turn=None if plan.turn is None else (ids(plan.turn[0]), ids(plan.turn[1])),
        media=suffix_media((features[0], features[1]), len(suffix[0])),
    )


def features_of(body: Mapping[str, Any], ids: Sequence[int]) -> Any:
    """The ``features`` the fake's render answers for `body` rendered as `ids`."""
    return render_features(body["messages"], ids, {})


def staged_prior(
    messages: Sequence[Mapping[str, Any]],
    sampled: str,
    answer: Mapping[str, Any],
    *,
    finish_reason: str = "stop",
    tools: Sequence[Any] | None = None,
    drop_past_reasoning: bool = True,
    **keys: Any,
) -> Prior:
    """A staged call: `messages` rendered into its prompt, `sampled` the text the model
    generated (a ``stop`` completion ends on ``<|im_end|>``, a ``length`` one does not), `answer`
    the assistant message the client received; its images placed as the fake's render places
    them (`Prior.media`)."""
    request: dict[str, Any] = {"model": MODEL, "messages": list(messages), **keys}
    if tools:
        request["tools"] = list(tools)
    completion = encode(sampled) + ([IM_END] if finish_reason == "stop" else [])
    prompt = render_ids(request, drop_past_reasoning=drop_past_reasoning)
    return Prior(
        request=request,
        message=answer,
        prompt_ids=prompt,
        completion_ids=completion,
        finish_reason=finish_reason,
        media=media_items(features_of(request, prompt)),
    )


def continued(prior: Prior, replayed: Mapping[str, Any], *appended: Any) -> dict[str, Any]:
    """The next request: the prior's, its answer replayed as `replayed`, then `appended`."""
    return {
        **prior.request,
        "messages": [*prior.request["messages"], replayed, *appended],
    }


async def beside_counts(proxy: Proxy) -> dict[str, float]:
    """`capture_proxy_token_in_beside_total` on the proxy's `/metrics`, by its `result` label."""
    return await labelled_counts(proxy, "capture_proxy_token_in_beside_total")


async def labelled_counts(proxy: Proxy, name: str) -> dict[str, float]:
    """A counter with one label on the proxy's `/metrics`, by that label's value."""
    text = await (await proxy.client.get("/metrics")).text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            label, value = line.split("} ")
            out[label.split('"')[1]] = float(value)
    return out


BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}


def tool_turns(turns: int) -> list[tuple[Prior, dict[str, Any]]]:
    """An agent loop's calls as (the staged call, the next request): each answer a `bash` call
    with reasoning, replayed as it came, its result appended."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "List the files."},
    ]
    out = []
    for k in range(turns):
        arguments = f'{{"command":"ls dir{k}"}}'
        call = {
            "id": f"c{k}",
            "type": "function",
            "function": {"name": "bash", "arguments": arguments},
        }
        answer = {
            "role": "assistant",
            "content": "",
            "reasoning_content": "hm",
            "tool_calls": [call],
        }
        sampled = "<think>\nhm\n</think>\n\n" + tool_call_text("bash", arguments)
        prior = staged_prior(messages, sampled, answer, tools=[BASH])
        result = {"role": "tool", "tool_call_id": f"c{k}", "content": f"file{k}.py"}
        request = continued(prior, answer, result)
        out.append((prior, request))
        messages = request["messages"]
    return out


@contextlib.asynccontextmanager
async def served(fake: FakeVLLM) -> AsyncIterator[HTTPUpstream]:
    """A client of `fake` served over HTTP, both closed at the end."""
    server = TestServer(fake.app())
    await server.start_server()
    client = HTTPUpstream(str(server.make_url("")))
    try:
        yield client
    finally:
        await client.close()
        await server.close()
