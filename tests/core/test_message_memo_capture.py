"""Through a running proxy, a rollout's re-sent messages are hashed once for its digests, its
records verify exactly, and the memo lets go of a rollout once it leaves memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capture_proxy.schemas.digest import verify_record
from capture_proxy.sinks.codec import MESSAGE_KEYS
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user

TOKEN = "admin-secret"


async def _turn(p: Proxy, rollout: str, history: list[dict[str, Any]], text: str) -> Any:
    messages = [*history, user(text)]
    resp = await p.chat(chat_body(*messages), rollout=rollout)
    assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
    answer = (await resp.json())["choices"][0]["message"]
    return [*messages, {"role": "assistant", "content": answer["content"]}]


async def test_re_sent_messages_are_hashed_once_and_records_verify(tmp_path: Path) -> None:
    p = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        memo = p.state.capture._message_digests
        history: list[dict[str, Any]] = []
        for text in ("hello", "go on", "and then?"):
            history = await _turn(p, "ep", history, text)
        # Calls sent 1, 3 and 5 messages: each after the first re-sends the earlier ones and
        # adds two (the answer it got, the next question).
        assert memo.misses == 1 + 2 + 2
        assert memo.hits == 0 + 1 + 3
        for record in p.calls("ep"):
            verify_record(record)
        assert p.state.capture.evict_idle(0.0) == ["ep"]
        assert len(memo) == 0
        assert memo.bytes == 0
    finally:
        await stop_proxy(p)


async def test_sealing_a_rollout_drops_its_messages(tmp_path: Path) -> None:
    p = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        memo = p.state.capture._message_digests
        await _turn(p, "ep", [], "hello")
        await _turn(p, "other", [], "hi")
        sealed = await p.client.post(
            "/admin/rollouts/ep/seal", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert sealed.status == 200
        assert len(memo) == 1  # the other rollout's message
        # The stores' memo of blob keys lets go of it too (process-wide: count this rollout's).
        assert "ep" not in MESSAGE_KEYS
        assert "other" in MESSAGE_KEYS
    finally:
        await stop_proxy(p)
