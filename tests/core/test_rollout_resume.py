"""A rollout the proxy no longer holds in memory (a restart, idle eviction) resumes from the store
on every path, refused calls included: sequence numbers continue, lineage holds, the manifest
lists every call, and a sealed rollout stays sealed."""

from __future__ import annotations

import dataclasses
import logging
from array import array
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.core.capture import Capture
from capture_proxy.core.rollouts import prior_of
from capture_proxy.errors import CaptureUnavailable, Conflict
from capture_proxy.library import CaptureClient
from capture_proxy.schemas.records import LedgerEntry, StagedCallRecord
from capture_proxy.schemas.token_in_extras import MediaItem
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.registry import open_sink, open_source
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
#: A message field the strict schema refuses: the call is a 422, before anything is forwarded.
BAD = chat_body({"role": "user", "content": "x", "thinking_trace": 1})


async def _turn(p: Proxy, history: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Send the conversation so far plus `text`; returns it with the answer appended."""
    messages = [*history, user(text)]
    resp = await p.chat(chat_body(*messages), rollout="ep")
    assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
    answer = (await resp.json())["choices"][0]["message"]
    return [*messages, {"role": "assistant", "content": answer["content"]}]


async def _manifest_seqs(p: Proxy) -> list[tuple[int, str]]:
    sealed = await p.client.post("/admin/rollouts/ep/seal", headers=ADMIN)
    assert sealed.status == 200
    return [(c["seq"], c["status"]) for c in (await sealed.json())["calls"]]


def _store_seqs(p: Proxy) -> tuple[list[int], list[int]]:
    src = open_source(p.store_url)
    try:
        staged = [s.seq for s in src.summaries("ep")]
        failed = [f.seq for f in src.failures("ep")]
    finally:
        src.close_reader()
    return staged, failed


async def _refused_then_good(p: Proxy, history: list[dict[str, Any]], refused: Any) -> None:
    resp = await refused()
    assert resp.status in (400, 413, 422)
    assert resp.headers["X-Capture-Status"] == "rejected"
    await _turn(p, history, "and then?")
    staged, failed = _store_seqs(p)
    assert staged == [0, 1, 3]
    assert failed == [2]
    _, second, third = p.calls("ep")
    assert third.parent_call_id == second.call_id
    assert await _manifest_seqs(p) == [
        (0, "staged"),
        (1, "staged"),
        (2, "rejected"),
        (3, "staged"),
    ]


@pytest.mark.parametrize("refusal", ["422", "413"])
async def test_a_refused_call_after_a_restart_continues_the_rollout(
    tmp_path: Path, refusal: str
) -> None:
    first = await start_proxy(tmp_path, admin_token=TOKEN, max_body_bytes=4000)
    history = await _turn(first, [], "hello")
    history = await _turn(first, history, "go on")
    await stop_proxy(first)
    second = await start_proxy(tmp_path, admin_token=TOKEN, max_body_bytes=4000)
    try:

        async def refused() -> Any:
            if refusal == "413":
                return await second.chat(chat_body(user("x" * 5000)), rollout="ep")
            return await second.chat(BAD, rollout="ep")

        await _refused_then_good(second, history, refused)
    finally:
        await stop_proxy(second)


async def test_a_refused_call_after_idle_eviction_continues_the_rollout(tmp_path: Path) -> None:
    p = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        history = await _turn(p, [], "hello")
        history = await _turn(p, history, "go on")
        assert p.state.capture.evict_idle(0.0) == ["ep"]

        async def refused() -> Any:
            return await p.chat(BAD, rollout="ep")

        await _refused_then_good(p, history, refused)
    finally:
        await stop_proxy(p)


@pytest.mark.parametrize("call", ["good", "refused"])
async def test_a_sealed_rollout_stays_sealed_after_a_restart(tmp_path: Path, call: str) -> None:
    first = await start_proxy(tmp_path, admin_token=TOKEN)
    await _turn(first, [], "hello")
    assert (await first.client.post("/admin/rollouts/ep/seal", headers=ADMIN)).status == 200
    await stop_proxy(first)
    second = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        for _ in range(2):  # the first call finds the seal in the store, the second in memory
            body = chat_body(user("late")) if call == "good" else BAD
            resp = await second.chat(body, rollout="ep")
            assert resp.status == 409
            assert (await resp.json())["error"]["code"] == "rollout_sealed"
            assert "X-Capture-Status" not in resp.headers
        then = await second.chat(chat_body(user("late")), rollout="ep")
        assert then.status == 409
        assert _store_seqs(second) == ([0], [])
        assert len(second.fake.requests) == 0
        # Sealing again answers the stored manifest, and leaves the rollout's header as it was.
        again = await second.client.post("/admin/rollouts/ep/seal", headers=ADMIN)
        assert [c["seq"] for c in (await again.json())["calls"]] == [0]
        manifest = await second.client.get("/admin/rollouts/ep/manifest", headers=ADMIN)
        assert [c["status"] for c in (await manifest.json())["calls"]] == ["staged"]
        src = open_source(second.store_url)
        try:
            info = src.rollout_info("ep")
        finally:
            src.close_reader()
        assert info.state == "sealed"
        assert info.created_at_ms > 0
    finally:
        await stop_proxy(second)


async def test_creating_a_rollout_the_store_already_has_is_409(tmp_path: Path) -> None:
    first = await start_proxy(tmp_path, admin_token=TOKEN)
    created = await first.client.post(
        "/admin/rollouts", json={"rollout_id": "ep", "metadata": {"task": 7}}, headers=ADMIN
    )
    assert created.status == 201
    await stop_proxy(first)
    second = await start_proxy(tmp_path, admin_token=TOKEN)
    try:
        again = await second.client.post(
            "/admin/rollouts", json={"rollout_id": "ep"}, headers=ADMIN
        )
        assert again.status == 409
        src = open_source(second.store_url)
        try:
            assert src.rollout_info("ep").metadata == {"task": 7}
        finally:
            src.close_reader()
    finally:
        await stop_proxy(second)


def _library(url: str) -> CaptureClient:
    return CaptureClient(open_sink(url), source=lambda: open_source(url))


async def test_library_refusal_after_a_restart_continues_the_rollout(tmp_path: Path) -> None:
    from capture_proxy.schemas.request import RequestValidationError

    url = f"sqlite:///{tmp_path / 'lib.db'}"
    client = _library(url)
    await client.begin_call("ep", chat_body(user("a")))  # admitted, then left unfinished
    await client.capture.reject("ep", "test", "refused before the restart", 422)
    await client.close()
    client = _library(url)
    with pytest.raises(RequestValidationError):
        await client.begin_call("ep", BAD)
    call = await client.begin_call("ep", chat_body(user("b")))
    assert call.call.seq == 3
    await client.close()
    src = open_source(url)
    try:
        assert [f.seq for f in src.failures("ep")] == [1, 2]
    finally:
        src.close_reader()


async def test_library_call_to_a_sealed_rollout_after_a_restart_is_409(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'lib.db'}"
    client = _library(url)
    await client.capture.reject("ep", "test", "one refused call", 422)
    await client.seal("ep", 0.1)
    await client.close()
    for body in (BAD, chat_body(user("late"))):
        client = _library(url)
        with pytest.raises(Conflict):
            await client.begin_call("ep", body)
        await client.close()
    src = open_source(url)
    try:
        assert [f.seq for f in src.failures("ep")] == [0]
        assert src.rollout_info("ep").state == "sealed"
    finally:
        src.close_reader()


async def test_a_call_whose_rollout_left_memory_since_it_was_resolved_is_503(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'core.db'}"
    capture = Capture(open_sink(url), source=lambda: open_source(url), max_live_rollouts=1)
    try:
        await capture.reject("a", "test", "refused", 422)  # seq 0 of "a", in the store
        await capture.ensure_rollout("a")
        await capture.ensure_rollout("b")  # over the cap of one: "a" leaves memory
        assert "a" not in capture.rollouts
        with pytest.raises(CaptureUnavailable) as e:
            capture.begin_call("a", chat_body(user("x")))
        assert e.value.code == "rollout_not_loaded"
        await capture.ensure_rollout("a")
        assert capture.begin_call("a", chat_body(user("x"))).seq == 1
    finally:
        await capture.sink.close()


class _LedgerDown(MemorySink):
    """A store whose ledger writes fail while `down` is set (records still stage)."""

    down = True

    async def record_failure(self, entry: LedgerEntry) -> None:
        if self.down:
            raise StoreError("the ledger is down")
        await super().record_failure(entry)


async def test_rollouts_stay_in_memory_while_ledger_entries_are_held() -> None:
    sink = _LedgerDown()
    capture = Capture(sink, source=lambda: sink, stage_timeout=1.0)
    live = await capture.ensure_rollout("ep")
    live.enter()
    live.leave()  # it has been active: idle eviction may take it
    await capture.reject("ep", "test", "refused while the ledger is down", 422)
    assert len(capture.ledger.held) == 1
    # The store does not have seq 0 yet: resuming from it now would hand seq 0 out again.
    assert capture.evict_idle(0.0) == []
    sink.down = False
    assert await capture.ledger.flush() == 0
    assert capture.evict_idle(0.0) == ["ep"]
    await capture.reject("ep", "test", "refused again", 422)
    assert [f.seq for f in sink.failures("ep")] == [0, 1]


def test_a_token_in_record_with_unreadable_image_placeholders_resumes_without_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A record whose ``token_in_media`` is not of the recorded shape (not written by this
    proxy) does not stop its rollout from resuming: its placeholders count as not recorded (the
    next call with images in its history starts a new segment, ``media_not_recorded``), and
    the log says which record and what is wrong."""
    image = {"type": "image_url", "image_url": {"url": "attachment:sha256:" + "a" * 64}}
    record = StagedCallRecord(
        rollout_id="ep",
        call_id="c0",
        seq=0,
        model="m",
        finish_reason="stop",
        request={"model": "m", "messages": [{"role": "user", "content": [image]}]},
        response={"role": "assistant", "content": "a cat"},
        prompt_token_ids=array("i", [1, 9, 2]),
        completion_token_ids=array("i", [3]),
        completion_logprobs=array("f", [-0.5]),
        token_in=True,
        extras={"token_in_media": [{"modality": "image", "hash": "h", "offset": -3, "length": 1}]},
    )
    with caplog.at_level(logging.WARNING, logger="capture_proxy.rollouts"):
        prior = prior_of(record)
    assert prior.stored
    assert prior.media is None
    [logged] = caplog.records
    assert logged.getMessage() == (
        "token-in record c0 keeps unreadable image placeholders: extras.token_in_media[0]: "
        'must be a non-empty list of {"modality": a non-empty string, "hash": a non-empty '
        'string, "offset": a position >= 0, "length": an int >= 1}, in prompt order without '
        "overlaps, got {'modality': 'image', 'hash': 'h', 'offset': -3, 'length': 1}"
    )
    well = dataclasses.replace(
        record, extras={"token_in_media": [{**record.extras["token_in_media"][0], "offset": 1}]}
    )
    assert prior_of(well).media == (MediaItem("image", "h", 1, 1),)
