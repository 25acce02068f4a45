"""``--store-linger``: a Parquet writer under load commits a unit at most once per linger, each
holding every call staged meanwhile; a first write, an admission claim and `close` never wait
for it. (What it costs a call and saves the store: bench/bench_linger.py.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import check_chain, claim_event
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.parquet._checkpoint import load_markers
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.registry import open_sink
from tests.support.s3 import MotoS3
from tests.support.sink_factories import Session

#: Far longer than any wait below: a test that waited for the linger would time out first.
_LONG = 60.0
_PROMPT = 30.0


def _calls_per_unit(ds: Path) -> list[int]:
    markers = [json.loads(p.read_text()) for p in sorted((ds / "_commits").glob("*.json"))]
    return [m["rows"].get("calls", 0) for m in markers]


async def test_calls_staged_within_the_linger_of_a_unit_share_the_next_unit(
    tmp_path: Path,
) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds), linger_s=1.5, linger_capped=False)
    try:
        first = await asyncio.wait_for(sink.stage(Session("first").next()[0]), _PROMPT)
        assert first.status is CallStatus.STAGED
        # Four calls arriving one after another, 50 ms apart, just after that unit: without a
        # linger each would be a unit of its own (the writer is idle when each arrives).
        tasks = []
        for i in range(4):
            tasks.append(asyncio.ensure_future(sink.stage(Session(f"s{i}").next()[0])))
            await asyncio.sleep(0.05)
        results = await asyncio.wait_for(asyncio.gather(*tasks), _PROMPT)
    finally:
        await sink.close()
    assert [r.status for r in results] == [CallStatus.STAGED] * 4
    assert _calls_per_unit(ds) == [1, 4]
    source = ParquetSource(str(ds))
    assert sorted(source.rollouts()) == ["first", "s0", "s1", "s2", "s3"]


async def test_a_first_call_and_an_admission_claim_do_not_wait_for_the_linger(
    tmp_path: Path,
) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds), linger_s=_LONG, linger_capped=False)
    session = Session("ep")
    try:
        record, _ = session.next()
        # Nothing committed lately: the first unit is written at once.
        claim = await asyncio.wait_for(
            sink.append_event(claim_event("ep", 0, record.call_id, 1)), _PROMPT
        )
        assert claim.kind == "claim"
        staged = await asyncio.wait_for(sink.stage(record), _PROMPT)
        assert staged.status is CallStatus.STAGED
        # A unit was just committed, but a claim writes none: its call goes upstream at once.
        nxt, _ = session.next()
        claim = await asyncio.wait_for(
            sink.append_event(claim_event("ep", 1, nxt.call_id, 2)), _PROMPT
        )
        assert claim.seq == 1
    finally:
        await sink.close()
    assert _calls_per_unit(ds) == [1, 0]  # the second claim's event, written at close


async def test_close_commits_a_lingering_call_without_waiting_for_the_linger(
    tmp_path: Path,
) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds), linger_s=_LONG, linger_capped=False)
    await asyncio.wait_for(sink.stage(Session("a").next()[0]), _PROMPT)
    lingering = asyncio.ensure_future(sink.stage(Session("b").next()[0]))
    await asyncio.sleep(0.2)
    assert not lingering.done()  # within the linger of the first unit
    await asyncio.wait_for(sink.close(), _PROMPT)
    assert (await asyncio.wait_for(lingering, _PROMPT)).status is CallStatus.STAGED
    assert sorted(ParquetSource(str(ds)).rollouts()) == ["a", "b"]


async def test_a_linger_is_no_longer_than_the_last_commit_took(tmp_path: Path) -> None:
    # The proxy's default: a local folder's commit takes milliseconds, so a call right after a
    # unit waits about that long, not the whole (here one-minute) linger.
    sink = ParquetSink(str(tmp_path / "ds"), linger_s=_LONG)
    try:
        await asyncio.wait_for(sink.stage(Session("a").next()[0]), _PROMPT)
        nxt = await asyncio.wait_for(sink.stage(Session("b").next()[0]), 5.0)
    finally:
        await sink.close()
    assert nxt.status is CallStatus.STAGED


async def test_every_store_kind_takes_the_linger_setting(tmp_path: Path) -> None:
    parquet = open_sink(f"parquet:///{tmp_path / 'ds'}", linger_s=0.25)
    assert isinstance(parquet, ParquetSink)
    # A local folder commits at once (its units are cheap to read back); object storage
    # lingers (the moto test below opens its sinks directly, as the proxy's would be).
    assert parquet._writer.linger_s == 0
    await parquet.close()
    # SQLite and the in-process store commit at once: the setting is theirs to drop.
    sqlite = open_sink(f"sqlite:///{tmp_path / 'x.db'}", linger_s=0.25)
    await sqlite.close()
    open_sink("memory://linger", linger_s=0.25)


async def test_two_writers_lingering_on_moto_group_their_calls_and_a_handed_rollout_continues(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    a = ParquetSink(url, writer_id="proxy-a", linger_s=2.0, linger_capped=False)
    b = ParquetSink(url, writer_id="proxy-b", linger_s=2.0, linger_capped=False)
    handed = Session("ho")
    try:
        first, _ = handed.next()
        await asyncio.wait_for(a.append_event(claim_event("ho", 0, first.call_id, 1)), _PROMPT)
        assert (await asyncio.wait_for(a.stage(first), _PROMPT)).status is CallStatus.STAGED
        second, _ = handed.next()  # seq 1 through b: a hand-off, while both writers linger
        await asyncio.wait_for(b.append_event(claim_event("ho", 1, second.call_id, 2)), _PROMPT)
        opened = asyncio.ensure_future(b.stage(Session("b-first").next()[0]))
        tasks = [asyncio.ensure_future(b.stage(second))]
        for i in range(3):
            tasks.append(asyncio.ensure_future(a.stage(Session(f"a{i}").next()[0])))
            tasks.append(asyncio.ensure_future(b.stage(Session(f"b{i}").next()[0])))
            await asyncio.sleep(0.05)
        results = await asyncio.wait_for(asyncio.gather(opened, *tasks), _PROMPT)
    finally:
        await a.close()
        await b.close()
    assert [r.status for r in results] == [CallStatus.STAGED] * 8
    live = load_markers(DatasetFS(url), object_url=url).live()
    # Nine calls (and two claims' events) in at most five units: a's first, a's three calls
    # together; b's first (and the hand-off), b's others, lingering after it.
    assert sum(m.rows.get("calls", 0) for m in live) == 9
    assert len(live) <= 5
    source = ParquetSource(url)
    assert len(source.rollouts()) == 8
    events = source.events("ho")
    assert check_chain(events) == []
    assert [(e.kind, e.seq) for e in events] == [
        ("claim", 0),
        ("staged", 0),
        ("handoff", None),
        ("claim", 1),
        ("staged", 1),
    ]
    Store(source).verify()
