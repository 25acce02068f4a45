"""An outcome whose event cannot be written is not kept quietly: the driver gets a 503 and sends
it again, and then the header and the event log agree (verified reads hold one to the other)."""

from __future__ import annotations

from pathlib import Path

from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import EventDraft, EventKind, RolloutEvent
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.memory import MemorySink
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


class _OutcomeEventsDown(MemorySink):
    """A store that takes everything but outcome events while `down` is set."""

    down = False

    async def append_event(self, event: EventDraft) -> RolloutEvent:
        if self.down and event.kind is EventKind.OUTCOME:
            raise StoreError("the event log is read-only")
        return await super().append_event(event)


async def test_an_outcome_not_chained_is_a_503_and_its_retry_makes_the_rollout_verify(
    tmp_path: Path,
) -> None:
    sink = _OutcomeEventsDown()
    p = await start_proxy(tmp_path, sink=sink, admin_token=TOKEN)
    try:
        assert (await p.chat(chat_body(user("hi")), rollout="ep")).status == 200
        await p.client.post("/admin/rollouts/ep/seal", headers=ADMIN)
        sink.down = True
        resp = await p.client.put("/admin/rollouts/ep/outcome", json={"reward": 1}, headers=ADMIN)
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
        assert error["code"] == "outcome_not_chained"
        assert "send it again" in error["message"]
        problems = Store(sink).check("ep")
        assert problems == ["its header has an outcome its event log does not"]
        sink.down = False
        resp = await p.client.put("/admin/rollouts/ep/outcome", json={"reward": 1}, headers=ADMIN)
        assert resp.status == 200
        assert Store(sink).check("ep") == []
        assert Store(sink).trajectory("ep").reward == 1.0
    finally:
        await stop_proxy(p)
