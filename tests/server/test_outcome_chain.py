"""A rollout's header and its event log agree again after an honest failure between their two
writes (verified reads hold one to the other): an outcome whose event cannot be written is a 503
that changed nothing, and a seal cut by a stop is completed by the seal sent again."""

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


async def test_an_outcome_whose_event_cannot_be_written_is_a_503_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """The event goes first: when it cannot be written the header is left as it was, and the
    rollout still verifies; the driver's retry writes both."""
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
        assert error["code"] == "outcome_not_stored"
        assert "nothing was changed" in error["message"]
        assert Store(sink).check("ep") == []
        assert sink.rollout_info("ep").outcome is None
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
    """A store whose header says sealed and whose log has no seal event (a release that wrote
    the header first and stopped between the two writes) is a rollout verified reads refuse; the
    driver's seal sent again (to the restarted proxy) writes the missing event, and the answer's
    chain head ends there."""
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
