"""The suite every sink passes (`tests/support/sink_factories.py` registers them): what
`StagingSink` and `StagingSource` promise, checked through each backend's own files.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.read.reader import Store, StoreCorrupted
from capture_proxy.read.status import RolloutExcluded
from capture_proxy.schemas.attachments import attachment_url
from capture_proxy.schemas.digest import DigestMismatch, seal_record, verify_record
from capture_proxy.schemas.events import (
    EventDraft,
    EventKind,
    chain_event,
    check_chain,
    claim_event,
)
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import (
    Attachment,
    CallStatus,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
    StageResult,
)
from capture_proxy.sinks.base import DuplicateSeq
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


async def test_one_image_under_two_media_types_keeps_each_records_own(case: SinkCase) -> None:
    """Two calls send the same bytes, as image/png and then as image/jpeg: the bytes are stored
    once, and each record reads back with (and verifies against) the media type it was sent
    with, not the first one stored."""
    png = image("two-types")
    jpeg = Attachment(png.sha256, "image/jpeg", png.data)
    session = Session("types", image=png)
    first = await stage_session(case, session, 1)
    session.images[png.sha256] = session.known[png.sha256] = jpeg
    second = await stage_session(case, session, 2)
    await case.sink.close()
    source = case.reopen()
    read = source.calls("types", include_orphaned=True)
    assert [r.call_id for r in read] == [r.call_id for r in (*first, *second)]
    assert [[a.media_type for a in r.attachments] for r in read] == [
        ["image/png"],
        ["image/jpeg"],
        ["image/jpeg"],
    ]
    for r, s in zip(read, (*first, *second), strict=True):
        assert_same(r, s)
        assert r.attachments[0].data == png.data
    assert [r.attachments[0].media_type for r in source.fetch([second[0].call_id])] == [
        "image/jpeg"
    ]
    assert case.attachment_count() == 1
    with Store(source) as store:
        store.verify()


async def test_a_store_of_the_release_before_reference_media_types_reads_and_verifies(
    tmp_path: Path, kind: str
) -> None:
    """A store whose references carry no media type of their own (SQLite format 5, Parquet
    calls without ``attachment_media_types``) reads each with its bytes' media type and
    verifies, before and after a writer opens it, and the session goes on in it."""
    case = SINKS[kind](tmp_path)
    session = Session("pre6", image=image("pre6"))
    old = await stage_session(case, session, 2)
    reopens = kind != "memory"
    if reopens:
        await case.sink.close()
    case.drop_reference_media_types()
    for record in case.reopen().fetch([r.call_id for r in old]):  # before any writer opens it
        assert [a.media_type for a in record.attachments] == ["image/png"]
        verify_record(record)
    if reopens:
        case = SINKS[kind](tmp_path)  # a writer opens the store: SQLite migrates it
    new = await stage_session(case, session, 1)
    await case.sink.close()
    source = case.reopen()
    read = source.fetch([r.call_id for r in (*old, *new)])
    for r, s in zip(read, (*old, *new), strict=True):
        assert_same(r, s)
        assert [a.media_type for a in r.attachments] == ["image/png"]
    with Store(source) as store:
        store.verify()


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


# -- the event log and admission claims ----------------------------------------------------------


async def test_a_claim_holds_its_seq_against_every_other_call(case: SinkCase) -> None:
    sink = case.sink
    record, _ = Session("ep").next()
    event = await sink.append_event(claim_event("ep", 0, record.call_id, 1))
    assert (event.position, event.kind, event.seq, event.prev_hash) == (0, "claim", 0, "")
    with pytest.raises(DuplicateSeq) as refused:
        await sink.append_event(claim_event("ep", 0, "other", 2))
    assert refused.value.holder == record.call_id
    other = replace(record, call_id="other")
    other = seal_record(replace(other, digest="", extras_digest=""))
    result = await sink.stage(other)
    assert (result.status, result.reason) == (CallStatus.CAPTURE_FAILED, "duplicate_seq")
    with pytest.raises(DuplicateSeq):
        await sink.record_failure(
            LedgerEntry("ep", "other", 0, CallStatus.UPSTREAM_ERROR, "x", "y", 502, 3)
        )
    assert (await sink.stage(record)).status == "staged"  # the claim's own call
    source = case.reopen()
    assert source.claims("ep") == {0: record.call_id}
    assert [e.kind for e in source.events("ep")] == ["claim", "staged"]


async def test_a_claim_is_refused_naming_whoever_holds_the_seq(case: SinkCase) -> None:
    sink = case.sink
    session = Session("eh")
    first, _ = session.next()
    second, _ = session.next()
    await sink.append_event(claim_event("eh", 0, first.call_id, 1))
    with pytest.raises(DuplicateSeq) as claimed:
        await sink.append_event(claim_event("eh", 0, "late", 2))
    assert claimed.value.holder == first.call_id
    assert (await sink.stage(second)).status == "staged"  # seq 1, staged with no claim
    with pytest.raises(DuplicateSeq) as staged:
        await sink.append_event(claim_event("eh", 1, "late", 3))
    assert staged.value.holder == second.call_id
    await sink.record_failure(
        LedgerEntry("eh", "failed", 2, CallStatus.UPSTREAM_ERROR, "x", "y", 502, 4)
    )
    with pytest.raises(DuplicateSeq) as ledger:
        await sink.append_event(claim_event("eh", 2, "late", 5))
    assert ledger.value.holder == "failed"
    assert await sink.append_event(claim_event("eh", 3, "late", 6))  # a free seq is claimed


async def test_the_event_log_chains_claims_outcomes_and_seals(case: SinkCase) -> None:
    sink = case.sink
    record, _ = Session("ep").next()
    await sink.append_event(claim_event("ep", 0, record.call_id, 1))
    assert (await sink.stage(record)).status == "staged"
    await sink.append_event(claim_event("ep", 1, "x1", 2))
    await sink.record_failure(
        LedgerEntry("ep", "x1", 1, CallStatus.UPSTREAM_ERROR, "upstream_500", "boom", 502, 3)
    )
    # Sealed as the proxy seals (a header that says so, then the seal event): `verify` holds
    # the header to the chain.
    await sink.put_rollout(RolloutInfo("ep", RolloutState.SEALED, False, 0, 4))
    await sink.append_event(EventDraft("ep", EventKind.SEAL, 4))
    await sink.append_event(claim_event("other", 0, "o0", 5))  # another rollout: its own chain
    # A Parquet claim is durable as its claim file; its event commits with the next unit, or at
    # close (docs/storage.md).
    await sink.close()
    source = case.reopen()
    events = source.events("ep")
    assert [(e.position, e.kind, e.seq, e.call_id) for e in events] == [
        (0, "claim", 0, record.call_id),
        (1, "staged", 0, record.call_id),
        (2, "claim", 1, "x1"),
        (3, "ledger", 1, "x1"),
        (4, "seal", None, None),
    ]
    assert events[1].body == {"digest": record.digest}
    assert events[3].body["status"] == "upstream_error"
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(events))
    assert check_chain(events) == []
    assert [e.position for e in source.events("other")] == [0]
    with Store(source) as store:
        store.verify()
        assert not store.status("ep").poisoned  # an upstream error does not poison


async def test_a_claimed_call_with_no_record_nor_ledger_entry_is_lost_in_crash(
    case: SinkCase,
) -> None:
    record, _ = Session("ep").next()
    await case.sink.append_event(claim_event("ep", 0, record.call_id, 1))
    assert (await case.sink.stage(record)).status == "staged"
    await case.sink.append_event(claim_event("ep", 1, "lost", 2))
    with Store(case.reopen()) as store:
        status = store.status("ep")
        assert status.poisoned
        assert [(n.seq, n.call_id, n.status) for n in status.not_staged] == [
            (1, "lost", "lost_in_crash")
        ]
        store.verify()  # a crash is not corruption
        with pytest.raises(RolloutExcluded, match="lost_in_crash"):
            store.calls("ep", include_open=True)


def test_an_edited_event_breaks_the_chain_at_its_position() -> None:
    events = []
    head: tuple[int, str] | None = None
    for i in range(3):
        e = chain_event(claim_event("ep", i, f"c{i}", i), head)
        events.append(e)
        head = (e.position, e.hash)
    assert check_chain(events) == []
    edited = [events[0], replace(events[1], call_id="intruder"), events[2]]
    assert [(b.position, b.message) for b in check_chain(edited)] == [
        (1, "edited: its hash does not match")
    ]
    assert [(b.position, b.message) for b in check_chain([events[0], events[2]])] == [
        (1, "event 1 is missing (the next stored event is at position 2)")
    ]
