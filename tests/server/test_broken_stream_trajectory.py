"""Tokens the policy generated in a stream that broke are never trained as prompt.

Through the proxy to the bundled fake vLLM: a streamed answer breaks after a few chunks (the
client got part of it, then an SSE error event), the client replays the partial answer in its
next request, and the rollout's trajectory puts that next call in a segment of its own (a
``not_staged`` break naming the broken call), with a loss mask of 1 on the staged completions
only. The rollout is not poisoned: the client saw the error.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus
from capture_proxy.testing.fake_vllm import FakeVLLM, Fault, Turn
from tests.support.proxy_harness import chat_body, sse_lines, user


async def _stream(
    p: Any, messages: list[dict[str, Any]], *, leave_after: int | None = None
) -> tuple[str, bool]:
    """Send a streamed call; the content the client received, and whether it ended well.
    `leave_after` closes the connection after that many content chunks (the client went away)."""
    resp = await p.chat(chat_body(*messages, stream=True))
    assert resp.status == 200
    text, done, chunks = "", False, 0
    async for line in sse_lines(resp):
        if line == b"data: [DONE]":
            done = True
        elif line.startswith(b"data: "):
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices", ()):
                piece = choice.get("delta", {}).get("content") or ""
                text += piece
                chunks += bool(piece)
            if leave_after is not None and chunks >= leave_after:
                resp.close()
                return text, False
    return text, done


@pytest.mark.parametrize(
    "fault", [Fault.reset_after(4), Fault.error_event(after=4)], ids=["reset", "error_event"]
)
async def test_a_broken_streams_replayed_tokens_open_a_segment_of_their_own(
    make_proxy: Any, fault: Fault
) -> None:
    fake = FakeVLLM()
    fake.push(
        Turn("the first answer, whole"),
        Turn("a second answer that breaks off before its end", fault=fault),
        Turn("the third answer"),
    )
    p = await make_proxy(fake=fake)
    first, ok = await _stream(p, [user("one")])
    assert ok
    history = [user("one"), {"role": "assistant", "content": first}, user("two")]
    partial, ok = await _stream(p, history)
    assert not ok
    assert partial  # the client holds part of what the policy generated
    replayed = [*history, {"role": "assistant", "content": partial}, user("go on")]
    _, ok = await _stream(p, replayed)
    assert ok
    (broken,) = p.failures()
    assert broken.status is CallStatus.UPSTREAM_ERROR
    staged = p.calls()
    assert [c.seq for c in staged] == [0, 2]

    with open_store(p.store_url) as store:
        traj = store.trajectory("r1", include_open=True)
    assert not traj.poisoned
    assert traj.calls == [c.call_id for c in staged]
    (brk,) = traj.breaks
    assert (brk.call_id, brk.reason) == (staged[1].call_id, "not_staged")
    assert brk.detail is not None
    assert brk.detail.call_id == broken.call_id  # type: ignore[union-attr]
    assert len(traj.segments) == 2
    # The third call's whole prompt, the partial answer in it included, is prompt (mask 0) of a
    # sequence of its own; the policy's tokens trained are the two staged completions.
    third = staged[1]
    start = brk.position
    assert traj.token_ids[start : start + len(third.prompt_token_ids)] == third.prompt_token_ids
    assert not any(traj.loss_mask[start : start + len(third.prompt_token_ids)])
    assert sum(traj.loss_mask) == len(staged[0].completion_token_ids) + len(
        third.completion_token_ids
    )


async def test_an_aborted_streams_replayed_tokens_open_a_segment_of_their_own(
    make_proxy: Any,
) -> None:
    fake = FakeVLLM(chunk_delay=0.05)
    fake.push(Turn("first"), Turn("a long second answer the client stops reading"), Turn("third"))
    p = await make_proxy(fake=fake)
    first, _ = await _stream(p, [user("one")])
    history = [user("one"), {"role": "assistant", "content": first}, user("two")]
    partial, ok = await _stream(p, history, leave_after=2)
    assert partial
    assert not ok
    for _ in range(100):  # the proxy notices the client went away, then writes the ledger
        if p.failures():
            break
        await asyncio.sleep(0.05)
    (aborted,) = p.failures()
    assert aborted.status is CallStatus.ABORTED
    replayed = [*history, {"role": "assistant", "content": partial}, user("go on")]
    await _stream(p, replayed)
    with open_store(p.store_url) as store:
        traj = store.trajectory("r1", include_open=True)
    assert not traj.poisoned
    (brk,) = traj.breaks
    assert brk.reason == "not_staged"
    assert brk.detail.call_id == aborted.call_id  # type: ignore[union-attr]
