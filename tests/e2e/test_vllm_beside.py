"""Generate sent beside the request's own render (``--token-in-beside on``) against the real
vLLM 0.32 (`-m vllm`; docs/token-in.md, "The whole-request check beside generate").

A session's third call (its close and anchors learnt by the second) goes out as soon as its
dummy renders answer, built from the second call's render: vLLM's own render then resolves the
same request (the sampling, the limit worked out for the bridged prompt), so the call is kept,
and answers and is staged as with the setting off. A limit the prompt's room binds differs
(vLLM resolves ``min(max_model_len - len(prompt), max_tokens)`` for the plain prompt): that
generation is aborted, recorded, and the call sent again the ordinary way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.token_in_extras import beside_aborted_of
from scripts.tiny_vllm import MAX_MODEL_LEN, SERVED_MODEL_NAME
from tests.e2e.test_vllm import IM_END
from tests.support.parity import agent_view
from tests.support.proxy_harness import Proxy, start_proxy, stop_proxy
from tests.support.token_in import beside_counts

pytestmark = pytest.mark.vllm

SYSTEM = {"role": "system", "content": "You are terse."}


def base(**extra: Any) -> dict[str, Any]:
    """Greedy, the turn ended at once (`<|im_end|>` biased): each answer is short whatever its
    limit."""
    return {
        "model": SERVED_MODEL_NAME,
        "temperature": 0,
        "logit_bias": {IM_END: 100},
        **extra,
    }


async def ask(proxy: Proxy, messages: list[dict[str, Any]], limit: int | None) -> dict[str, Any]:
    """One unary call: the assistant message as the agent replays it."""
    body = {**base(), "messages": messages}
    if limit is not None:
        body["max_tokens"] = limit
    resp = await proxy.chat(body)
    assert resp.status == 200, await resp.text()
    said = (await resp.json())["choices"][0]["message"]
    replayed = {"role": "assistant", "content": said.get("content") or ""}
    if said.get("reasoning"):
        replayed["reasoning"] = said["reasoning"]
    return replayed


async def third(
    proxy: Proxy, messages: list[dict[str, Any]], limit: int | None, stream: bool
) -> dict[str, Any]:
    """The agent's view of the session's third call."""
    body = {**base(), "messages": messages}
    if limit is not None:
        body["max_tokens"] = limit
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return await agent_view(proxy.chat, body)


FIRST: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Say it."}]


async def session(
    proxy: Proxy, limit: int | None, stream: bool
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Three calls with `limit` as their ``max_tokens`` (None: none), the third streamed or
    not: the agent's view of the third, and the messages it was sent."""
    messages = list(FIRST)
    for text in ("Go on.", "Once more."):
        messages = [*messages, await ask(proxy, messages, limit), {"role": "user", "content": text}]
    return await third(proxy, messages, limit, stream), messages


def staged(proxy: Proxy) -> list[tuple[list[int], list[int], str | None, Any]]:
    return [
        (list(r.prompt_token_ids), list(r.completion_token_ids), r.finish_reason, r.bridge_spans)
        for r in proxy.calls()
    ]


async def prompt_length(vllm_url: str, messages: list[dict[str, Any]]) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{vllm_url}/v1/chat/completions/render",
            json={"model": SERVED_MODEL_NAME, "messages": messages},
        ) as resp,
    ):
        return len((await resp.json())["token_ids"])


@pytest.mark.parametrize("limit", [8, None], ids=["max_tokens", "no limit"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_call_sent_beside_its_render_is_kept_and_answers_as_without(
    vllm_url: str, tmp_path: Path, stream: bool, limit: int | None
) -> None:
    off = await start_proxy(tmp_path / "off", upstream=vllm_url, token_in="on")
    on = await start_proxy(tmp_path / "on", upstream=vllm_url, token_in="on", token_in_beside="on")
    try:
        off_view, _ = await session(off, limit, stream)
        on_view, _ = await session(on, limit, stream)
        # vLLM's render of the request resolved the request sent beside it: kept.
        assert await beside_counts(on) == {"passed": 1.0}
        assert on_view == off_view
        assert staged(on) == staged(off)
        assert [r.bridge_spans != () for r in on.calls()] == [False, True, True]
    finally:
        await stop_proxy(off)
        await stop_proxy(on)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_limit_the_room_binds_aborts_the_generation_sent_beside_and_sends_it_again(
    vllm_url: str, tmp_path: Path, stream: bool
) -> None:
    """The second call's render resolved ``max_tokens`` to the request's limit; the third's
    plain prompt leaves less room than that, so vLLM resolves the room instead: the
    generation sent with the limit is aborted and the call sent again with vLLM's."""
    off = await start_proxy(tmp_path / "off", upstream=vllm_url, token_in="on")
    on = await start_proxy(tmp_path / "on", upstream=vllm_url, token_in="on", token_in_beside="on")
    try:
        views = []
        for proxy in (off, on):
            messages = [*FIRST, await ask(proxy, FIRST, 8), {"role": "user", "content": "Go on."}]
            # Exactly the room the second call's prompt leaves: the third's leaves less.
            limit = MAX_MODEL_LEN - await prompt_length(vllm_url, messages)
            messages = [*messages, await ask(proxy, messages, limit)]
            messages.append({"role": "user", "content": "Once more."})
            views.append(await third(proxy, messages, limit, stream))
        assert await beside_counts(on) == {"max_tokens": 1.0}
        assert views[1] == views[0]
        *_, last = on.calls()
        aborted = beside_aborted_of(last.extras)
        assert aborted is not None
        assert aborted.reason == "max_tokens"
        assert staged(on) == staged(off)
        store = open_store(on.store_url)
        store.verify()
        assert len(store.trajectory("r1", include_open=True).segments) == 1
    finally:
        await stop_proxy(off)
        await stop_proxy(on)
