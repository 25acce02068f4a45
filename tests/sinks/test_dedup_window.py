"""The writer's side of the window rule: a Parquet writer shares a blob or attachment only with a
copy committed less than `dedup_window_s` ago, so gc may remove older copies while it writes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow.parquet as pq

from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from tests.support.sink_factories import Session, image


def _rows(ds: Path, table: str) -> list[dict[str, object]]:
    return [r for f in sorted((ds / table).glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


async def test_copies_older_than_the_window_are_stored_again_or_refused(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds), dedup_window_s=0.3)
    shot = image("window")
    s = Session("r", image=shot)
    first, given = s.next()
    assert (await sink.stage(first, attachments=given)).coords is not None
    within, given = s.next()  # within the window: shares the image and the history's blobs
    assert (await sink.stage(within, attachments={})).coords is not None
    blobs_before = len(_rows(ds, "blobs"))
    await asyncio.sleep(0.4)

    later, given = s.next()
    refused = await sink.stage(later, attachments={})  # a reference alone, to an old copy
    assert (refused.status.value, refused.reason) == ("capture_failed", "missing_attachment")
    assert refused.message == (
        f"the request refers to attachment {shot.sha256}, which was neither given nor already "
        "stored"
    )
    again = await sink.stage(later, attachments=given)  # with its bytes: stored anew
    assert again.coords is not None
    await sink.close()
    assert [r["sha256"] for r in _rows(ds, "attachments")] == [shot.sha256, shot.sha256]
    # The system prompt and tools were stored again too (a few bytes; readers keep either copy).
    assert len(_rows(ds, "blobs")) > blobs_before + 1
    source = ParquetSource(str(ds))
    assert [r.call_id for r in source.calls("r")] == [first.call_id, within.call_id, later.call_id]
    assert [a.sha256 for a in source.calls("r")[-1].attachments] == [shot.sha256]


async def test_a_restarted_writer_ages_copies_by_their_units(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    shot = image("restart")
    s = Session("r", image=shot)
    sink = ParquetSink(str(ds))
    first, given = s.next()
    await sink.stage(first, attachments=given)
    await sink.close()
    sink = ParquetSink(str(ds), dedup_window_s=3600)  # committed a moment ago: shared
    nxt, _ = s.next()
    assert (await sink.stage(nxt, attachments={})).coords is not None
    await sink.close()
    await asyncio.sleep(0.3)
    sink = ParquetSink(str(ds), dedup_window_s=0.2)  # its unit is older than the window now
    last, _ = s.next()
    refused = await sink.stage(last, attachments={})
    assert refused.reason == "missing_attachment"
    await sink.close()


async def test_a_writer_remembers_its_latest_attachments_and_asks_the_store_for_older(
    tmp_path: Path,
) -> None:
    # A proxy writes for weeks: it remembered every attachment it ever stored (about 0.2 KB
    # each). Now the latest `max_attachment_keys`: one it forgot is stored again when its bytes
    # come with the call, and a reference alone to it is checked against the store.
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds), max_attachment_keys=1)
    a, b = Session("a", image=image("a")), Session("b", image=image("b"))
    try:
        for session in (a, b):
            record, given = session.next()
            assert (await sink.stage(record, attachments=given)).coords is not None
        assert len(sink._shared.attachments) == 1  # b's: a's fell out
        record, given = a.next()
        assert (await sink.stage(record, attachments=given)).coords is not None  # stored again
        assert len(sink._shared.attachments) == 1
        record, _ = b.next()
        assert (await sink.stage(record, attachments={})).coords is not None  # from the store
    finally:
        await sink.close()
    shas = [r["sha256"] for r in _rows(ds, "attachments")]
    assert shas == [image("a").sha256, image("b").sha256, image("a").sha256]
    source = ParquetSource(str(ds))
    for rollout in ("a", "b"):
        assert all(len(r.attachments) == 1 for r in source.calls(rollout))
