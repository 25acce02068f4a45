"""What the bridge refuses to bridge across, through the proxy against the fake vLLM: a new
segment with its reason (docs/token-in.md, "When the bridge does not bridge")."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestServer

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.token_in_extras import segment_break_of
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn
from tests.support.proxy_harness import Proxy, chat_body, user
from tests.support.replicas import OtherTemplate

SYSTEM = {"role": "system", "content": "You are a coding agent."}


async def restart(p: Proxy, fake: FakeVLLM) -> None:
    """Stop the proxy's upstream and start `fake` on the same port (a vLLM restarted under the
    same served name)."""
    port = p.upstream.port
    await p.upstream.close()
    p.upstream = TestServer(fake.app(), port=port)
    await p.upstream.start_server()
    p.fake = fake


async def ask(p: Proxy, messages: list[dict[str, Any]]) -> dict[str, Any]:
    resp = await p.chat(chat_body(*messages))
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Capture-Status"] == "staged"
    message = (await resp.json())["choices"][0]["message"]
    return {"role": "assistant", "content": message["content"] or ""}


async def test_a_call_after_the_tokenizer_changed_starts_a_new_segment(make_proxy: Any) -> None:
    p = await make_proxy(fake=FakeVLLM(scale_out=True), token_in="on")
    p.fake.push(Turn("First."))
    messages = [SYSTEM, user("One.")]
    answer = await ask(p, messages)
    # The same served name, another tokenizer + template: the staged ids are another vocabulary.
    other = OtherTemplate(scale_out=True)
    other.push(Turn("Second."), Turn("Third."))
    await restart(p, other)
    messages += [answer, user("Two.")]
    answer = await ask(p, messages)
    await ask(p, [*messages, answer, user("Three.")])
    first, second, third = p.calls()
    assert second.tokenizer_fingerprint != first.tokenizer_fingerprint
    cut = segment_break_of(second.extras)
    assert cut is not None
    assert cut.reason == "tokenizer_changed"
    assert first.tokenizer_fingerprint in cut.detail
    assert not second.bridge_spans
    # Its prompt is the new template's own rendering, not the old ids bridged on.
    assert list(second.prompt_token_ids[: len(first.prompt_token_ids)]) != list(
        first.prompt_token_ids
    )
    # Under the same new fingerprint, the next call extends it again.
    assert segment_break_of(third.extras) is None
    assert third.bridge_spans
    # The trainer's trajectory breaks there, with the reason.
    traj = open_store(p.store_url).trajectory("r1", include_open=True)
    assert len(traj.segments) == 2
    assert [(b.call_id, b.reason) for b in traj.breaks] == [(second.call_id, "tokenizer_changed")]
