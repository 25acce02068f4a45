"""A rollout's header and its event log agree again after an honest failure between their two
writes (verified reads hold one to the other): an outcome whose event cannot be written is a 503
the driver retries, and a seal cut by a stop is completed by the seal sent again."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from capture_proxy.read.reader import Store, open_store
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


async def test_a_seal_cut_between_header_and_event_is_completed_by_the_drivers_retry(
    tmp_path: Path,
) -> None:
    """A proxy that stopped after writing the sealed header and before the seal event leaves a
    rollout verified reads refuse; the driver's seal sent again (to the restarted proxy) writes
    the missing event, and the answer's chain head ends there."""
    p = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        assert (await p.chat(chat_body(user("hi")), rollout="ep")).status == 200
        assert (await p.client.post("/admin/rollouts/ep/seal", headers=ADMIN)).status == 200
    finally:
        await stop_proxy(p)
    db = sqlite3.connect(tmp_path / "store.db")
    with db:
        db.execute("DELETE FROM events WHERE rollout_id = 'ep' AND kind = 'seal'")
    db.close()
    with open_store(p.store_url) as store:
        assert store.check("ep") == ["its header says sealed; its event log has no seal event"]
    p = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        answer = await (await p.client.post("/admin/rollouts/ep/seal", headers=ADMIN)).json()
        with open_store(p.store_url) as store:
            assert store.check("ep") == []
            events = store.source.events("ep")
            assert events[-1].kind == "seal"
            assert answer["chain_head"] == events[-1].hash
    finally:
        await stop_proxy(p)
