"""`StagingSource.summaries`: each staged call's scalar facts without decoding its tokens or
messages, agreeing with `calls()` on every sink; and the inspect overview that is built on them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from capture_proxy.inspect.views import InspectError, overview, rollout_view
from capture_proxy.read.reader import Store
from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.records import (
    Attachment,
    CallStatus,
    CallSummary,
    LedgerEntry,
    StagedCallRecord,
)
from capture_proxy.sinks.base import StagingSink, StagingSource
from capture_proxy.sinks.parquet import ParquetSource, compact_store
from capture_proxy.sinks.parquet._index import SMALL_UNIT_BYTES
from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource
from tests.support.sink_factories import SINKS, ParquetCase, Session, SinkCase, image

ROLLOUTS = ("ra", "rb", "rc", "never-seen")


@pytest.fixture(params=sorted(SINKS))
async def case(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SinkCase]:
    c = SINKS[str(request.param)](tmp_path, None)
    try:
        yield c
    finally:
        await c.sink.close()


def from_calls(source: StagingSource, rollout_id: str) -> list[CallSummary]:
    """What `summaries` must say, worked out from the fully decoded records."""
    records = source.calls(rollout_id, include_orphaned=True)
    coords = source.coords([r.call_id for r in records])
    orphaned = source.orphaned()
    return [
        CallSummary(
            call_id=r.call_id,
            seq=r.seq,
            parent_call_id=r.parent_call_id,
            retry_of=r.retry_of,
            finish_reason=r.finish_reason,
            prompt_len=len(r.prompt_token_ids),
            completion_len=len(r.completion_token_ids),
            cum_len=r.cum_len,
            prev_len=c.prev_len,
            created_at_ms=r.created_at_ms,
            weight_version=r.weight_version,
            orphaned=r.call_id in orphaned,
        )
        for r, c in zip(records, coords, strict=True)
    ]


async def staged(
    sink: StagingSink, record: StagedCallRecord, atts: Mapping[str, Attachment] | None = None
) -> None:
    result = await sink.stage(record, attachments=atts) if atts else await sink.stage(record)
    assert result.status is CallStatus.STAGED, result


async def stage_story(sink: StagingSink) -> None:
    """`ra`: an image session, a retry cut by length. `rb`: a drift, a new weight version and an
    orphaned record. `rc`: a failure only."""
    a = Session("ra", image=image("ra"))
    ra = []
    for _ in range(3):
        record, atts = a.next()
        await staged(sink, record, atts)
        ra.append(record)
    retry = replace(ra[2], call_id="ra-retry", seq=3, retry_of="ra-c2", finish_reason="length")
    await staged(sink, seal_record(retry, attachments=atts), atts)
    b = Session("rb")
    for turn in range(3):
        record, _ = b.next(drift_at=7 if turn == 2 else None)
        if turn == 2:
            record = seal_record(replace(record, weight_version=2))
        await staged(sink, record)
    await sink.mark_orphaned("rb-c1", "stage_timeout")
    await sink.record_failure(
        LedgerEntry("rc", "rc-x", 0, CallStatus.REJECTED, "invalid_request", "bad key", 422)
    )


async def test_summaries_agree_with_calls(case: SinkCase) -> None:
    await stage_story(case.sink)
    source = case.reopen()
    for rollout_id in ROLLOUTS:
        assert source.summaries(rollout_id) == from_calls(source, rollout_id)
    ra = {s.call_id: s for s in source.summaries("ra")}
    assert [s.seq for s in ra.values()] == [0, 1, 2, 3]
    assert (ra["ra-retry"].retry_of, ra["ra-retry"].finish_reason) == ("ra-c2", "length")
    assert ra["ra-c1"].prev_len == ra["ra-c0"].cum_len  # extends its parent
    rb = source.summaries("rb")
    assert [s.orphaned for s in rb] == [False, True, False]  # flagged, not left out
    assert rb[2].prev_len == 7 < rb[1].cum_len  # the drift
    assert rb[2].weight_version == 2
    assert all(s.prompt_len + s.completion_len == s.cum_len for s in ra.values())
    assert source.summaries("rc") == [] == source.summaries("never-seen")
    source.close_reader()


async def test_parquet_summaries_after_compaction_and_from_large_units(tmp_path: Path) -> None:
    c = ParquetCase(tmp_path)
    await stage_story(c.sink)
    # A call whose unit is too large to be read whole while indexing: its summary columns come
    # from a projected read of the row group, not from a cached one.
    big, _ = Session("big").next(new_prompt=600_000)
    await staged(c.sink, big)
    await c.sink.close()
    sizes = [
        orjson.loads(p.read_bytes())["bytes"] for p in (c.location / "_commits").glob("*.json")
    ]
    assert max(sizes) > SMALL_UNIT_BYTES
    before = ParquetSource(str(c.location))
    want = {r: from_calls(before, r) for r in (*ROLLOUTS, "big")}
    assert {r: before.summaries(r) for r in want} == want
    assert want["big"][0].prompt_len == 600_000

    compact_store(str(c.location), grace_s=0)  # the files `before` indexed are gone
    assert {r: before.summaries(r) for r in want} == want  # re-lists and reads the merged unit
    after = ParquetSource(str(c.location))
    assert {r: after.summaries(r) for r in want} == want


async def test_overview_counts_without_decoding_records(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    sink = SQLiteSink(str(path))
    await stage_story(sink)
    await sink.close()
    with Store(SQLiteSource(str(path))) as store:
        want = overview(store)
    # A record of `ra` loses half its stored tokens: the rollout no longer decodes, but the
    # overview reads only scalar columns, so it still lists every rollout, with the same counts.
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE calls SET delta_tokens = substr(delta_tokens, 1, 8) WHERE call_id = 'ra-c1'"
        )
    db.close()
    with Store(SQLiteSource(str(path))) as store:
        assert overview(store) == want
        with pytest.raises(InspectError, match=r"rollout 'ra' cannot be read .*--verify"):
            rollout_view(store, "ra")
    (ra,) = [r for r in want["rollouts"] if r["rollout_id"] == "ra"]
    assert (ra["calls"], ra["statuses"]) == (4, {"staged": 4})
    (rb,) = [r for r in want["rollouts"] if r["rollout_id"] == "rb"]
    assert (rb["orphaned"], rb["poisoned"]) == (1, True)
    (rc,) = [r for r in want["rollouts"] if r["rollout_id"] == "rc"]
    assert (rc["calls"], rc["statuses"], rc["prompt_tokens"]) == (1, {"rejected": 1}, 0)
