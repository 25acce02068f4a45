"""The checkpoint's horizon, on moto's S3 server: an open lists only the commit markers named
after it (retired ones before it are not even listed), a unit committed while readers open is
never missed, a long-lived reader follows a maintenance run that merged units before its
horizon, a checkpoint written before horizons existed still opens (listing every name), and a
writer whose commit outlasts `COMMIT_LIMIT_S` retracts its unit and says so."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import orjson
import pytest

from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource, _writer
from capture_proxy.sinks.parquet._checkpoint import CHECKPOINT, load_markers
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._gc import gc_parquet
from capture_proxy.sinks.parquet._layout import COMMIT_MARGIN_S, Marker, list_markers
from tests.support.maintenance import compact_all
from tests.support.s3 import MotoS3
from tests.support.sealing import put_sealed
from tests.support.sink_factories import Session, stage_parquet

DAY_MS = 86_400_000
#: How far in the past `_age` moves units: well before any horizon written now.
_AGO_NS = 3600 * 10**9


async def _stage(url: str, rollouts: list[str], calls: int) -> list[str]:
    """`calls` records in each rollout, one unit each; the staged call ids."""
    staged = await stage_parquet(url, [Session(r) for r in rollouts], calls)
    return [record.call_id for record in staged]


def _age(url: str, by_ns: int = _AGO_NS) -> None:
    """Rename every unit an hour older (`by_ns` older), as if committed then (markers name
    their files)."""
    dfs = DatasetFS(url)
    for name in list_markers(dfs):
        old = Marker.decode(dfs.read(f"_commits/{name}.json"))
        order, ident = name.split("-", 1)
        unit = f"{int(order) - by_ns:020d}-{ident}"
        files = {t: f"{t}/{unit}.parquet" for t in old.files}
        dfs.put_all({files[t]: dfs.read(rel) for t, rel in old.files.items()})
        new = Marker(unit, files, dict(old.rows), old.retires, old.created_at_ms, old.size)
        dfs.put_all({new.rel: new.encode()})
        dfs.delete_many([old.rel, *old.files.values()])


def _rows(source: ParquetSource) -> dict[str, list[str]]:
    return {r: [c.call_id for c in source.calls(r)] for r in sorted(source.rollouts())}


async def test_an_open_does_not_list_markers_named_before_the_horizon(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await _stage(url, ["a", "b"], calls=4)
    _age(url)
    before = _rows(ParquetSource(url, index="units"))
    compact_all(url, grace_s=600)  # the 8 retired markers stay in _commits/
    dfs = DatasetFS(url)
    assert len(list_markers(dfs)) == 9
    body = orjson.loads(dfs.read(CHECKPOINT))
    horizon = int(body["listed_after"])
    assert time.time_ns() - horizon >= COMMIT_MARGIN_S * 1e9 - 5e9
    # Nothing is named after the horizon (the merged unit takes its last unit's order): the
    # open lists no name at all, and reads no marker; the rows are all there.
    loaded = load_markers(dfs, None, url)
    assert loaded.after == body["listed_after"]
    assert loaded.names == []
    assert [m.order for m in loaded.live()] == [int(list_markers(dfs)[-1].split("-")[0])]
    # A name before the horizon is not even listed: a marker there that no writer could have
    # written (not JSON) is never seen by an open, where a full listing would read it.
    dfs.put_all({f"_commits/{horizon - 10**9:020d}-notamarker.json": b"not a marker"})
    assert _rows(ParquetSource(url, index="units")) == before
    # Units committed now are after the horizon: listed and read.
    ids = await _stage(url, ["c"], calls=2)
    source = ParquetSource(url, index="units")
    assert _rows(source)["c"] == ids
    assert {k: v for k, v in _rows(source).items() if k != "c"} == before


async def test_a_checkpoint_written_before_horizons_lists_every_name(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await _stage(url, ["a"], calls=3)
    _age(url)
    before = _rows(ParquetSource(url, index="units"))
    compact_all(url, grace_s=600)
    dfs = DatasetFS(url)
    body = orjson.loads(dfs.read(CHECKPOINT))
    del body["listed_after"]  # as the release before horizons wrote it (format 1)
    dfs.put_all({CHECKPOINT: orjson.dumps(body)})
    loaded = load_markers(dfs, None, url)
    assert loaded.after is None
    assert len(loaded.names) == 4  # the three retired markers and the merged one
    assert _rows(ParquetSource(url, index="units")) == before
    # The next maintenance run writes the horizon again.
    compact_all(url, grace_s=0)
    assert "listed_after" in orjson.loads(dfs.read(CHECKPOINT))


async def test_a_long_lived_reader_follows_a_merge_of_units_before_its_horizon(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    await _stage(url, ["a", "b", "c"], calls=3)
    sink = ParquetSink(url, writer_id="w")
    await put_sealed(sink, RolloutInfo("b", RolloutState.SEALED, False, 0, 10))
    await sink.close()
    _age(url)
    compact_all(url, grace_s=600)  # one merged unit, named before the horizon
    reader = ParquetSource(url, index="units")
    try:
        assert sorted(reader.rollouts()) == ["a", "b", "c"]
        # gc removes the sealed rollout b: its merged unit takes the order of the unit it
        # rewrites, before the horizon, so no listing after it shows that marker; the reader
        # sees the checkpoint changed and opens from the new one.
        stats = gc_parquet(url, older_than_ms=DAY_MS, now_ms=10 + DAY_MS + 1)
        assert stats.rollouts == ["b"]
        assert sorted(reader.rollouts()) == ["a", "c"]
        assert len(reader.calls("c")) == 3
    finally:
        reader.close_reader()


async def test_a_unit_committed_while_readers_open_is_never_missed(moto_s3: MotoS3) -> None:
    url = moto_s3.url()
    await _stage(url, ["old"], calls=5)
    _age(url)
    compact_all(url, grace_s=600)
    acked: list[str] = []
    stop = threading.Event()
    failed: list[BaseException] = []

    def write() -> None:
        async def run() -> None:
            sink = ParquetSink(url, writer_id="busy")
            try:
                session = Session("busy")
                while not stop.is_set():
                    record, atts = session.next()
                    await sink.stage(record, attachments=atts)
                    acked.append(record.call_id)
                    await asyncio.sleep(0.2)
            finally:
                await sink.close()

        try:
            asyncio.run(run())
        except BaseException as e:
            failed.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        opens = 0
        deadline = time.monotonic() + 60
        # Six opens at least, and on until the writer has committed a few units meanwhile (a
        # loaded machine may commit fewer than six during six opens).
        while (opens < 6 or len(acked) <= 6) and time.monotonic() < deadline:
            if opens % 2 == 1:
                compact_all(url, grace_s=0)  # a new checkpoint (and horizon) between opens
            seen_before = list(acked)
            source = ParquetSource(url, index="units")
            try:
                got = {c.call_id for c in source.calls("busy")}
            finally:
                source.close_reader()
            assert set(seen_before) <= got, "an open missed a unit committed before it"
            opens += 1
        assert opens >= 6
    finally:
        stop.set()
        await asyncio.to_thread(writer.join)
    assert not failed
    assert len(acked) > 6


async def test_a_commit_that_outlasts_the_limit_is_retracted_and_fails_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = str(tmp_path / "ds")
    sink = ParquetSink(store, writer_id="w")
    try:
        session = Session("r")
        record, atts = session.next()
        await sink.stage(record, attachments=atts)
        # Every commit now counts as too slow (a host or store that stalled past the limit).
        monkeypatch.setattr(_writer, "COMMIT_LIMIT_S", -1.0)
        record, atts = session.next()
        with pytest.raises(StoreError, match=r"more than -1 s .* it was retracted"):
            await sink.stage(record, attachments=atts)
    finally:
        await sink.close()
    dfs = DatasetFS(store)
    assert len(list_markers(dfs)) == 1  # the first unit only: nothing of the second remains
    assert len(dfs.names("calls")) == 1
    source = ParquetSource(store)
    assert len(source.calls("r")) == 1


#: One answered request in moto's log: method, path (with its query).
_REQUEST = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP')


def _log_size(moto: MotoS3) -> int:
    time.sleep(0.15)  # moto logs a request once it has answered it
    return moto.log_path.stat().st_size


def _requests(moto: MotoS3, since: int) -> list[tuple[str, str]]:
    time.sleep(0.15)
    with moto.log_path.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return [(m[1], m[2]) for m in _REQUEST.finditer(text)]


async def test_a_checkpoint_that_changed_nothing_under_a_reader_costs_it_no_reindex(
    moto_s3: MotoS3,
) -> None:
    url = moto_s3.url()
    prefix = url.removeprefix("s3://").split("/", 1)[1]
    await _stage(url, ["a"], calls=3)
    _age(url)
    compact_all(url, grace_s=0)  # one merged unit
    reader = ParquetSource(url, index="units")
    try:
        assert len(reader.calls("a")) == 3
        compact_all(url, grace_s=0)  # nothing to merge: a new checkpoint all the same
        start = _log_size(moto_s3)
        assert len(reader.calls("a")) == 3
        requests = _requests(moto_s3, start)
        # The checkpoint's HEAD (changed), its GET, the listing after its horizon; no marker
        # and no data file read again (the calls row group is cached).
        assert ("HEAD", f"/capture/{prefix}/{CHECKPOINT}") in requests
        assert ("GET", f"/capture/{prefix}/{CHECKPOINT}") in requests
        lists = [p for m, p in requests if "list-type" in p]
        assert lists
        assert all("start-after=" in p for p in lists)  # S3's StartAfter
        data = [
            p for m, p in requests if "list-type" not in p and ("/_commits/" in p or "/calls/" in p)
        ]
        assert data == []
        # A refresh within `max_age_s` of the last listing lists nothing (the sink's follower
        # after a read or the proxy's weight version re-read took one).
        start = _log_size(moto_s3)
        reader.refresh(max_age_s=60)
        assert _requests(moto_s3, start) == []
        reader.refresh()
        assert [m for m, _ in _requests(moto_s3, start)] == ["HEAD", "GET"]  # HEAD, LIST
    finally:
        reader.close_reader()
