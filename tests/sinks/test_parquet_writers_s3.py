"""Several writers on one object-storage dataset, on moto's S3 server (a real S3 API on
loopback): the store itself refuses a second claim of a seq (a conditional PUT answered 412),
whichever writer asks; a reader sees every writer's units; a rollout continued by another writer
records a ``handoff`` event and keeps one unbroken chain, and the first writer, coming back with
what it held in memory, is refused the seq it would reuse and then continues after the last."""

from __future__ import annotations

import asyncio
import logging
import re

import obstore
import orjson
import pytest

from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import EventKind, check_chain, claim_event
from capture_proxy.schemas.records import CallStatus, RolloutInfo, RolloutState
from capture_proxy.sinks.base import DuplicateSeq
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._layout import create_dataset
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session, image


def _writer(url: str, name: str) -> ParquetSink:
    return ParquetSink(url, writer_id=name)


async def test_a_claim_is_created_once_by_the_store_whichever_writer_asks(
    moto_s3: MotoS3, caplog: pytest.LogCaptureFixture
) -> None:
    url = moto_s3.url()
    with caplog.at_level(logging.WARNING):
        a, b = _writer(url, "proxy-a"), _writer(url, "proxy-b")
    try:
        assert not [r for r in caplog.records if "not enforced" in r.getMessage()]
        await a.append_event(claim_event("ep.1", 7, "c7", 1))
        # b never saw a's claim in memory: the store answers 412, and b reads the holder.
        with pytest.raises(DuplicateSeq, match=r"rollout ep.1 already holds seq 7 \(call c7\)"):
            await b.append_event(claim_event("ep.1", 7, "other", 2))
        # The same call claiming its seq again (a retried write) is accepted.
        await a.append_event(claim_event("ep.1", 7, "c7", 1))
    finally:
        await a.close()
        await b.close()
    store = obstore.store.from_url(url)
    body = orjson.loads(bytes(obstore.get(store, "claims/ep%2E1/0000000007").bytes()))
    assert (body["call_id"], body["writer"]) == ("c7", "proxy-a")
    assert ParquetSource(url).claims("ep.1") == {7: "c7"}


async def test_two_writers_stage_into_one_dataset_and_a_reader_sees_both(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    a, b = _writer(url, "proxy-a"), _writer(url, "proxy-b")
    sa, sb = Session("ra", image=image("shared")), Session("rb", image=image("shared"))
    try:
        for _ in range(3):
            for sink, session in ((a, sa), (b, sb)):
                record, atts = session.next()
                assert (await sink.stage(record, attachments=atts)).status is CallStatus.STAGED
        # A record at a seq another writer's call holds is refused by the claim, not by memory.
        clash, atts = Session("ra", prefix="clash").next()
        refused = await b.stage(clash, attachments=atts)
        assert (refused.status, refused.reason) == (CallStatus.CAPTURE_FAILED, "duplicate_seq")
        assert "rollout ra already holds seq 0 (call ra-c0)" in (refused.message or "")
    finally:
        await a.close()
        await b.close()
    source = ParquetSource(url)
    assert sorted(source.all_keys()) == sorted(
        [f"{r}-c{i}" for r in ("ra", "rb") for i in range(3)]
    )
    Store(source).verify()  # the shared image stored by both writers: one copy is read


async def test_a_rollout_handed_to_another_writer_continues_one_chain(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    a, b = _writer(url, "proxy-a"), _writer(url, "proxy-b")
    s = Session("ep")
    try:
        for _ in range(2):  # seqs 0 and 1 through a
            record, atts = s.next()
            await a.append_event(claim_event("ep", record.seq, record.call_id, 1))
            assert (await a.stage(record, attachments=atts)).status is CallStatus.STAGED
        handed, atts = s.next()  # seq 2 through b: a handoff
        await b.append_event(claim_event("ep", 2, handed.call_id, 2))
        assert (await b.stage(handed, attachments=atts)).status is CallStatus.STAGED
        # a comes back holding the rollout in memory: the seq it would take next is b's.
        with pytest.raises(DuplicateSeq, match=re.escape(f"(call {handed.call_id})")):
            await a.append_event(claim_event("ep", 2, "stale", 3))
        # Refused, a dropped its stale copy: its next seq continues b's chain.
        after, atts = s.next()
        await a.append_event(claim_event("ep", 3, after.call_id, 4))
        assert (await a.stage(after, attachments=atts)).status is CallStatus.STAGED
    finally:
        await a.close()
        await b.close()
    source = ParquetSource(url)
    events = source.events("ep")
    assert check_chain(events) == []
    kinds = [(e.kind, e.seq) for e in events]
    assert kinds == [
        ("claim", 0),
        ("staged", 0),
        ("claim", 1),
        ("staged", 1),
        ("handoff", None),
        ("claim", 2),
        ("staged", 2),
        ("handoff", None),
        ("claim", 3),
        ("staged", 3),
    ]
    handoffs = [dict(e.body) for e in events if e.kind == EventKind.HANDOFF]
    assert handoffs == [
        {
            "from_writer": "proxy-a",
            "to_writer": "proxy-b",
            "after_seq": 1,
            "after_call_id": "ep-c1",
        },
        {
            "from_writer": "proxy-b",
            "to_writer": "proxy-a",
            "after_seq": 2,
            "after_call_id": handed.call_id,
        },
    ]
    assert [x.seq for x in source.summaries("ep")] == [0, 1, 2, 3]
    assert source.claims("ep") == {0: "ep-c0", 1: "ep-c1", 2: handed.call_id, 3: after.call_id}
    Store(source).verify()


async def test_a_writer_meeting_a_rollout_another_created_keeps_its_header(
    moto_s3: MotoS3,
) -> None:
    """The driver created the rollout through proxy a (its header: metadata, policy); its first
    call reaches proxy b, whose writer adds the implicit header of a first call: that never
    replaces the stored one."""
    url = moto_s3.url()
    a, b = _writer(url, "proxy-a"), _writer(url, "proxy-b")
    created = RolloutInfo(
        "ep",
        RolloutState.OPEN,
        False,
        1_700_000_000_000,
        metadata={"task": "t-17"},
        policy={"temperature": 0.5},
    )
    try:
        await a.put_rollout(created)
        record, atts = Session("ep").next()
        assert (await b.stage(record, attachments=atts)).status is CallStatus.STAGED
    finally:
        await a.close()
        await b.close()
    info = ParquetSource(url).rollout_info("ep")
    assert (info.metadata, info.policy, info.created_at_ms) == (
        {"task": "t-17"},
        {"temperature": 0.5},
        1_700_000_000_000,
    )


async def test_writers_creating_a_new_dataset_at_once_all_open_it(moto_s3: MotoS3) -> None:
    # A fleet's proxies starting together on a new prefix: each finds no format file and
    # creates the dataset. One that lists the prefix once another has written its format file
    # opens that dataset (it used to refuse it as "holds files but no _format.json").
    url = moto_s3.url()
    first = _writer(url, "proxy-a")
    try:
        create_dataset(DatasetFS(url))  # a second writer's create, after the first one's
    finally:
        await first.close()
    url = moto_s3.url()
    sinks = await asyncio.gather(*(asyncio.to_thread(_writer, url, f"w{i}") for i in range(4)))
    try:
        for i, sink in enumerate(sinks):
            record, atts = Session(f"r{i}").next()
            assert (await sink.stage(record, attachments=atts)).status is CallStatus.STAGED
    finally:
        for sink in sinks:
            await sink.close()
    assert ParquetSource(url).rollouts() == ["r0", "r1", "r2", "r3"]
