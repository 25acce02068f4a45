"""A sink written for text-only calls keeps working for them, and a call with an image through it
is capture_failed (never staged with its attachments dropped)."""

from __future__ import annotations

import base64
from typing import Any

from capture_proxy.schemas.records import CallStatus, StagedCallRecord, StageResult
from capture_proxy.sinks.memory import MemorySink
from tests.support.proxy_harness import chat_body, user


class TextOnlySink(MemorySink):
    """A third-party sink from before attachments: its stage() takes no `attachments`."""

    async def stage(self, record: StagedCallRecord) -> StageResult:  # type: ignore[override]
        return await super().stage(record)


async def test_text_only_sink_stages_text_and_refuses_images_loudly(make_proxy: Any) -> None:
    sink = TextOnlySink()
    p = await make_proxy(sink=sink)
    text = await p.chat(chat_body(user("just text")))
    assert text.headers["X-Capture-Status"] == "staged"
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"i" * 64).decode()
    image = await p.chat(
        chat_body({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]})
    )
    assert image.status == 200  # the answer still reaches the client (poison policy)
    assert image.headers["X-Capture-Status"] == "capture_failed"
    (entry,) = p.failures()
    assert entry.status is CallStatus.CAPTURE_FAILED
    assert entry.reason == "sink_rejected_attachments"
    assert [r.call_id for r in p.calls()] == [text.headers["X-Capture-Call-Id"]]
    assert sink.rollout_info("r1").poisoned
