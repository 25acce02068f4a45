"""The suite every sink passes (`tests/support/sink_factories.py` registers them): what
`StagingSink` and `StagingSource` promise, checked through each backend's own files.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.read.reader import Store, StoreCorrupted
from capture_proxy.schemas.attachments import attachment_url
from capture_proxy.schemas.digest import DigestMismatch, seal_record, verify_record
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import (
    CallStatus,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
    StageResult,
)
from tests.support.sink_factories import SINKS, V2_VALUES, Part, Session, SinkCase, image


class Fault:
    """A fault hook that raises at one armed point, and records every point it saw."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.seen: list[str] = []

    def __call__(self, point: str) -> None:
        self.seen.append(point)
        if point == self.armed:
            raise RuntimeError(f"injected fault at {point}")


@pytest.fixture(params=sorted(SINKS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def fault() -> Fault:
    return Fault()


@pytest.fixture
async def case(kind: str, tmp_path: Path, fault: Fault) -> AsyncIterator[SinkCase]:
    c = SINKS[kind](tmp_path, fault)
    try:
        yield c
    finally:
        await c.sink.close()


def assert_same(read: StagedCallRecord, staged: StagedCallRecord) -> None:
    assert read.staging_key == staged.staging_key
    assert read.digest == staged.digest
    assert read.extras_digest == staged.extras_digest
    assert read.prompt_token_ids == staged.prompt_token_ids
    assert read.completion_token_ids == staged.completion_token_ids
    assert read.completion_logprobs.tobytes() == staged.completion_logprobs.tobytes()
    assert read.request == staged.request
    assert read.response == staged.response
    assert read.extras == staged.extras
    assert read.parent_call_id == staged.parent_call_id
    verify_record(read)


async def stage_session(
    case: SinkCase, session: Session, turns: int, *, extras: dict[str, Any] | None = None
) -> list[StagedCallRecord]:
    out = []
    for _ in range(turns):
        record, atts = session.next(extras=extras)
        result = await (
            case.sink.stage(record, attachments=atts) if atts else case.sink.stage(record)
        )
        assert result.status is CallStatus.STAGED, result
        out.append(record)
    return out


@pytest.mark.parametrize("with_image", [False, True])
async def test_round_trip(case: SinkCase, with_image: bool) -> None:
    img = image("round-trip") if with_image else None
    extras = {"media_spans": [[3, 9]], "routed_experts": "AAEC", "n": 1.5}
    staged = await stage_session(case, Session("rt", image=img), 3, extras=extras)
    await case.sink.close()
    source = case.reopen()
    read = source.fetch([r.staging_key for r in staged])
    for r, s in zip(read, staged, strict=True):
        assert_same(r, s)
        assert [a.sha256 for a in r.attachments] == ([img.sha256] if img else [])
        if img:
            assert r.attachments[0].data == img.data
            assert r.attachments[0].media_type == "image/png"
    assert [r.call_id for r in source.calls("rt")] == [s.call_id for s in staged]
    assert source.rollouts() == ["rt"]
    Store(source).verify()


async def test_a_v2_record_round_trips_every_new_field(case: SinkCase) -> None:
    img = image("v2")
    session = Session("v2", image=img)
    plain, atts = session.next()
    record = seal_record(replace(plain, **V2_VALUES), attachments=atts)
    assert (await case.sink.stage(record, attachments=atts)).status is CallStatus.STAGED
    await case.sink.close()
    (read,) = case.reopen().fetch([record.call_id])
    assert_same(read, record)
    assert read.schema_version == 2
    for name, value in V2_VALUES.items():
        assert getattr(read, name) == value, name


async def test_an_edited_attachment_media_type_fails_verify(case: SinkCase) -> None:
    img = image("media")
    staged = await stage_session(case, Session("mt", image=img), 2)
    await case.sink.close()
    case.tamper(staged[0].call_id, "media_type")
    read = case.reopen().fetch([staged[0].call_id])[0]
    assert read.attachments[0].media_type == "image/jpeg"
    with pytest.raises(DigestMismatch, match=f"{staged[0].call_id}: digest mismatch"):
        verify_record(read)


async def test_a_store_of_the_previous_release_reads_verifies_and_takes_v2_records(
    tmp_path: Path, kind: str
) -> None:
    """Version-1 records stored without the schema-2 columns (the release before) read back as
    version 1 with defaults, verify with the v1 encoding, before and after a writer migrates the
    store, and the session continues with version-2 records."""
    case = SINKS[kind](tmp_path)
    img = image("old")
    session = Session("old", image=img, schema_version=1)
    old = await stage_session(case, session, 2)
    reopens = kind != "memory"  # a memory store lives in its sink: it goes on writing there
    if reopens:
        await case.sink.close()
    case.downgrade()
    for record in case.reopen().fetch([r.call_id for r in old]):  # before any writer opens it
        assert record.schema_version == 1
        assert record.logprobs_mode == "unknown"
        assert record.weight_spans == ()
        verify_record(record)
    if reopens:
        case = SINKS[kind](tmp_path)  # a writer opens the store: SQLite migrates it
    session.schema_version = 2
    new, atts = session.next()
    new = seal_record(replace(new, **V2_VALUES), attachments=atts)
    assert (await case.sink.stage(new, attachments=atts)).status is CallStatus.STAGED
    await case.sink.close()
    source = case.reopen()
    read = source.fetch([*(r.call_id for r in old), new.call_id])
    assert [r.schema_version for r in read] == [1, 1, 2]
    assert_same(read[-1], new)
    with Store(source) as store:
        store.verify()


async def test_linear_storage_and_drift(case: SinkCase) -> None:
    s = Session("lin")
    r0, _ = s.next(new_prompt=100, completion=20)
    r1, _ = s.next(new_prompt=30, completion=10)
    r2, _ = s.next(new_prompt=5, completion=5, drift_at=110)  # re-tokenized history
    coords = []
    for r in (r0, r1, r2):
        res = await case.sink.stage(r)
        assert res.coords is not None
        coords.append(res.coords)
    assert (coords[0].prev_len, coords[0].delta_len, coords[0].cum_len) == (0, 120, 120)
    assert (coords[1].prev_len, coords[1].delta_len, coords[1].cum_len) == (120, 40, 160)
    # The drifted call shares 110 tokens with its parent (plus any coincidental match after).
    assert coords[2].prev_len >= 110
    assert coords[2].prev_len < 160
    assert coords[2].prev_len + coords[2].delta_len == coords[2].cum_len == 120
    await case.sink.close()
    source = case.reopen()
    for r, got in zip(
        (r0, r1, r2), source.fetch([r0.call_id, r1.call_id, r2.call_id]), strict=True
    ):
        assert_same(got, r)
    assert source.coords([c.staging_key for c in coords]) == coords


@pytest.mark.parametrize("point", ["after_record", "after_attachments"])
async def test_fault_leaves_nothing(case: SinkCase, fault: Fault, point: str) -> None:
    first = Session("atom", image=image("first"))
    good, atts = first.next()
    assert (await case.sink.stage(good, attachments=atts)).status is CallStatus.STAGED
    fresh = image(f"never-stored-{point}")
    bad, bad_atts = Session("atom2", image=fresh).next()
    fault.armed = point
    with pytest.raises(RuntimeError, match="injected fault"):
        await case.sink.stage(bad, attachments=bad_atts)
    assert point in fault.seen
    fault.armed = None
    # The image of the failed call was not kept: referring to it without bytes is refused.
    again, _ = Session("atom3", image=fresh).next()
    refused = await case.sink.stage(again)
    assert refused.status is CallStatus.CAPTURE_FAILED
    assert refused.reason == "missing_attachment"
    await case.sink.close()
    source = case.reopen()
    assert list(source.all_keys()) == [good.call_id]
    assert source.calls("atom2") == []
    assert source.unreferenced_attachments() == []
    assert Store(source).problems() == []
    assert case.attachment_count() == 1


async def test_fault_then_same_key_stages(case: SinkCase, fault: Fault) -> None:
    record, atts = Session("retry", image=image("retry")).next()
    fault.armed = "after_attachments"
    with pytest.raises(RuntimeError):
        await case.sink.stage(record, attachments=atts)
    fault.armed = None
    result = await case.sink.stage(record, attachments=atts)
    assert result.status is CallStatus.STAGED
    await case.sink.close()
    (read,) = case.reopen().fetch([record.call_id])
    assert_same(read, record)


async def test_concurrent_stage(case: SinkCase) -> None:
    sessions = [
        Session(f"conc{i}", image=image(f"c{i}") if i % 3 == 0 else None) for i in range(10)
    ]

    async def run(s: Session) -> list[tuple[StagedCallRecord, StageResult]]:
        out = []
        for _ in range(5):
            r, atts = s.next()
            res = await (case.sink.stage(r, attachments=atts) if atts else case.sink.stage(r))
            out.append((r, res))
        return out

    results = [
        x for xs in await asyncio.wait_for(asyncio.gather(*map(run, sessions)), 30) for x in xs
    ]
    assert len(results) == 50
    assert all(res.status is CallStatus.STAGED for _, res in results)
    await case.sink.close()
    source = case.reopen()
    read = source.fetch([r.call_id for r, _ in results])
    for got, (want, res) in zip(read, results, strict=True):
        assert_same(got, want)
        assert source.coords([want.call_id]) == [res.coords]
    assert sorted(source.all_keys()) == sorted(r.call_id for r, _ in results)
    Store(source).verify()


async def test_duplicate_key_refused(case: SinkCase) -> None:
    original, _ = Session("dup").next()
    assert (await case.sink.stage(original)).status is CallStatus.STAGED
    impostor, _ = Session("dup", seed=7).next()  # same call id, other content
    assert impostor.call_id == original.call_id
    assert impostor.digest != original.digest
    result = await case.sink.stage(impostor)
    assert result.status is CallStatus.CAPTURE_FAILED
    assert result.reason == "duplicate_key"
    assert original.call_id in (result.message or "")
    await case.sink.close()
    (read,) = case.reopen().fetch([original.call_id])
    assert_same(read, original)


async def test_missing_attachment_refused(case: SinkCase) -> None:
    img = image("missing")
    record, _ = Session("miss", image=img).next()
    result = await case.sink.stage(record, attachments={})
    assert result.status is CallStatus.CAPTURE_FAILED
    assert result.reason == "missing_attachment"
    assert img.sha256 in (result.message or "")
    await case.sink.close()
    source = case.reopen()
    assert list(source.all_keys()) == []
    with pytest.raises(KeyError):
        source.fetch([record.call_id])


@pytest.mark.parametrize("part", ["tokens", "message", "attachment"])
async def test_tampering_detected(case: SinkCase, part: Part) -> None:
    staged = await stage_session(case, Session("tamper", image=image("tamper")), 2)
    await case.sink.close()
    Store(case.reopen()).verify()  # clean before
    target = staged[-1].call_id
    case.tamper(target, part)
    with pytest.raises(StoreCorrupted) as info:
        Store(case.reopen()).verify()
    assert target in {p.key for p in info.value.problems}
    assert target in str(info.value)


async def test_ledger_round_trip(case: SinkCase) -> None:
    sink = case.sink
    await sink.put_rollout(
        RolloutInfo("led", RolloutState.OPEN, False, 1000, None, {"task": "t1"}, {"k": 1})
    )
    await sink.record_failure(
        LedgerEntry("led", "led-c1", 1, CallStatus.REJECTED, "bad_request", "unknown key x", 422, 5)
    )
    good = await stage_session(case, Session("led"), 1)
    await sink.put_rollout(
        RolloutInfo("led", RolloutState.SEALED, False, 1000, 2000, {"task": "t1"}, {"k": 1})
    )
    await sink.record_failure(
        LedgerEntry("other", "o-c0", 0, CallStatus.UPSTREAM_ERROR, "upstream_500", "boom", 500, 6)
    )
    await sink.record_failure(
        LedgerEntry("poisoned", "p-c0", 0, CallStatus.CAPTURE_FAILED, "sink_error", "disk", None, 7)
    )
    orphan_session = Session("orph")
    orphans = await stage_session(case, orphan_session, 2)
    await sink.mark_orphaned(orphans[1].call_id, "stage_timeout")
    await sink.close()
    source = case.reopen()

    info = source.rollout_info("led")
    assert (info.state, info.poisoned, info.sealed_at_ms) == (RolloutState.SEALED, False, 2000)
    assert dict(info.metadata) == {"task": "t1"}
    assert dict(info.policy) == {"k": 1}
    (failure,) = source.failures("led")
    assert (failure.call_id, failure.status, failure.reason, failure.http_status) == (
        "led-c1",
        CallStatus.REJECTED,
        "bad_request",
        422,
    )
    assert [r.call_id for r in source.calls("led")] == [good[0].call_id]
    assert source.rollout_info("other").poisoned is False
    assert source.rollout_info("other").state is RolloutState.OPEN
    assert source.rollout_info("poisoned").poisoned is True
    assert source.failures("poisoned")[0].status is CallStatus.CAPTURE_FAILED
    assert source.rollout_info("orph").poisoned is True
    assert source.orphaned() == {orphans[1].call_id}
    assert [r.call_id for r in source.calls("orph")] == [orphans[0].call_id]
    assert [r.call_id for r in source.calls("orph", include_orphaned=True)] == [
        r.call_id for r in orphans
    ]
    assert set(source.rollouts()) == {"led", "other", "poisoned", "orph"}
    with pytest.raises(KeyError):
        source.rollout_info("nope")


async def test_a_header_keeps_its_outcome_history_apart_from_the_metadata(case: SinkCase) -> None:
    sink = case.sink
    first = RolloutOutcome(reward=0.25, group_id="g-1", at_ms=10)
    second = RolloutOutcome(
        reward={"correctness": 1.0, "format": -0.5}, metadata={"judge": "j-2"}, at_ms=20
    )
    await sink.put_rollout(
        RolloutInfo("graded", RolloutState.OPEN, False, 1000, None, {"task": "t1"}, {}, (first,))
    )
    staged = await stage_session(case, Session("graded"), 1)
    await sink.put_rollout(
        RolloutInfo(
            "graded", RolloutState.SEALED, False, 1000, 2000, {"task": "t1"}, {}, (first, second)
        )
    )
    await sink.put_rollout(RolloutInfo("plain", RolloutState.OPEN, False, 1000, None, {"a": 1}))
    await sink.close()
    source = case.reopen()

    info = source.rollout_info("graded")
    assert (info.state, info.sealed_at_ms) == (RolloutState.SEALED, 2000)
    assert dict(info.metadata) == {"task": "t1"}  # the history is not the driver's metadata
    assert info.outcome_history == (first, second)
    assert info.outcome == second
    assert [r.call_id for r in source.calls("graded")] == [staged[0].call_id]
    plain = source.rollout_info("plain")
    assert (plain.outcome_history, plain.outcome, dict(plain.metadata)) == ((), None, {"a": 1})


async def test_fetch_order_and_missing_key(case: SinkCase) -> None:
    staged = await stage_session(case, Session("order"), 3)
    await case.sink.close()
    source = case.reopen()
    keys = [staged[2].call_id, staged[0].call_id, staged[1].call_id, staged[0].call_id]
    assert [r.call_id for r in source.fetch(keys)] == keys
    with pytest.raises(KeyError, match="no-such-key"):
        source.fetch([staged[0].call_id, "no-such-key"])
    with pytest.raises(KeyError, match="no-such-key"):
        source.coords(["no-such-key"])
    records = Store(source).fetch(source.coords(keys))
    assert [r.call_id for r in records] == keys


async def test_survives_close_and_reopen(case: SinkCase) -> None:
    staged = await stage_session(case, Session("persist", image=image("persist")), 3)
    await case.sink.close()
    with pytest.raises(RuntimeError):
        await case.sink.stage(Session("late").next()[0])
    for _ in range(2):  # two independent readers see the same thing
        source = case.reopen()
        for got, want in zip(source.calls("persist"), staged, strict=True):
            assert_same(got, want)
        source.close_reader()


async def test_attachments_stored_once(case: SinkCase) -> None:
    img = image("shared")
    a, atts = Session("dedup-a", image=img).next()
    b, _ = Session("dedup-b", image=img).next()
    assert (await case.sink.stage(a, attachments=atts)).status is CallStatus.STAGED
    # Re-sent bytes are a dedup hit; so is a reference alone to bytes already stored.
    assert (await case.sink.stage(b, attachments=atts)).status is CallStatus.STAGED
    c, _ = Session("dedup-c", image=img).next()
    assert (await case.sink.stage(c)).status is CallStatus.STAGED
    await case.sink.close()
    assert case.attachment_count() == 1
    source = case.reopen()
    for r in source.fetch([a.call_id, b.call_id, c.call_id]):
        assert [x.data for x in r.attachments] == [img.data]
        verify_record(r)


async def test_attachments_in_order_of_first_reference(case: SinkCase) -> None:
    one, two = image("first-ref"), image("second-ref")
    s = Session("multi")
    s.messages[1] = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": attachment_url(two.sha256)}},
            {"type": "image_url", "image_url": {"url": attachment_url(one.sha256)}},
            {"type": "image_url", "image_url": {"url": attachment_url(two.sha256)}},
        ],
    }
    s.known = {one.sha256: one, two.sha256: two}
    record, _ = s.next()
    res = await case.sink.stage(record, attachments={one.sha256: one, two.sha256: two})
    assert res.status is CallStatus.STAGED
    await case.sink.close()
    (read,) = case.reopen().fetch([record.call_id])
    assert [a.sha256 for a in read.attachments] == [two.sha256, one.sha256]
