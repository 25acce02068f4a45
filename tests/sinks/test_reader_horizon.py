"""A long-lived reader's own listing horizon (`_refresh.Refreshing._roll`): once a listing has
shown it every name, its next listings ask only for the names after the point no marker can
land before any more (`COMMIT_MARGIN_S` before that listing began), on a dataset no maintenance
run has checkpointed, and it still sees every unit committed since, a compaction's merged unit
(through the checkpoint that run writes), and lists every name while a checkpoint is there but
not used; a unit landing late before its horizon (a writer's clock far behind) is missed by it
until an open, which reads it: nothing is lost."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from capture_proxy.sinks.parquet import ParquetSource
from capture_proxy.sinks.parquet._checkpoint import CHECKPOINT
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._layout import COMMIT_MARGIN_S, Marker, list_markers
from tests.sinks.test_checkpoint_horizon import _age, _rows, _stage
from tests.support.maintenance import compact_all


def _listings(reader: ParquetSource, monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The `after` of each listing of the commit markers the reader asks for from now on."""
    asked: list[str | None] = []
    names = reader.dfs.names

    def spy(rel: str, after: str | None = None) -> list[str]:
        if rel == "_commits":
            asked.append(after)
        return names(rel, after)

    monkeypatch.setattr(reader.dfs, "names", spy)
    return asked


@contextlib.asynccontextmanager
async def _aged_reader(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    rollouts: list[str],
    *,
    then: Callable[[str], None] | None = None,
    ago_ns: int = 3600 * 10**9,
) -> AsyncIterator[tuple[str, ParquetSource, list[str | None]]]:
    """Three calls of each of `rollouts` staged `ago_ns` ago (an hour: before any horizon set
    now), `then` done to the dataset; a units reader of it, and the `after` of each listing it
    asks for."""
    url = str(tmp_path / "ds")
    await _stage(url, rollouts, calls=3)
    _age(url, ago_ns)
    if then is not None:
        then(url)
    reader = ParquetSource(url, index="units")
    try:
        yield url, reader, _listings(reader, monkeypatch)
    finally:
        reader.close_reader()


async def test_a_long_lived_reader_lists_only_the_names_after_a_horizon_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _aged_reader(tmp_path, monkeypatch, ["a", "b"]) as (url, reader, asked):
        before = _rows(reader)  # the open lists every name (no checkpoint)
        assert sum(map(len, before.values())) == 6
        reader.refresh()
        horizon = asked[-1]
        assert horizon is not None
        oldest = min(list_markers(DatasetFS(url)))
        assert horizon > oldest
        assert abs(int(horizon) - (time.time_ns() - COMMIT_MARGIN_S * 1e9)) < 60e9
        # A name before the horizon is not even listed: a marker there no writer could have
        # written (not JSON) is never read, where a listing of every name would fail on it.
        planted = f"_commits/{int(horizon) - 10**9:020d}-notamarker.json"
        DatasetFS(url).put_all({planted: b"x"})
        reader.refresh()
        assert _rows(reader) == before
        # Units committed now are after the horizon: listed and read. (The planted name goes
        # first: the writer's open lists every name, as any open without a checkpoint.)
        DatasetFS(url).delete_many([planted])
        await _stage(url, ["c"], calls=2)
        reader.refresh()
        rows = _rows(reader)
        assert rows == {**before, "c": rows["c"]}
        assert len(rows["c"]) == 2
        assert all(after is not None and after >= horizon for after in asked[-3:])


async def test_a_writer_clock_ahead_does_not_move_the_reader_horizon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Units named an hour ahead (a writer whose clock is ahead): the reader's horizon follows its
    # own clock, so a unit another writer names now, behind them, is still listed and read.
    async with _aged_reader(tmp_path, monkeypatch, ["a"], ago_ns=-3600 * 10**9) as found:
        url, reader, asked = found
        assert len(reader.calls("a")) == 3
        reader.refresh()
        horizon = asked[-1]
        assert horizon is not None
        assert int(horizon) < time.time_ns()
        await _stage(url, ["b"], calls=2)
        reader.refresh()
        assert len(reader.calls("b")) == 2


async def test_a_unit_landing_before_the_horizon_is_missed_until_an_open_but_never_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A writer whose clock is an hour behind the reader's (beyond the 90 s the horizon allows):
    # its unit lands after the reader's listing with a name before its horizon.
    async with _aged_reader(tmp_path, monkeypatch, ["a"]) as (url, reader, asked):
        assert len(reader.calls("a")) == 3
        reader.refresh()
        assert asked[-1] is not None
        late = str(tmp_path / "late")
        await _stage(late, ["b"], calls=2)
        _age(late)
        src, dst = DatasetFS(late), DatasetFS(url)
        for name in list_markers(src):
            marker = Marker.decode(src.read(f"_commits/{name}.json"))
            dst.put_all({rel: src.read(rel) for rel in marker.files.values()})
            dst.put_all({marker.rel: marker.encode()})
        reader.refresh()
        assert reader.calls("b") == []  # the long-lived reader misses it...
        fresh = ParquetSource(url, index="units")
        try:  # ... and any open reads it whole: nothing is lost
            assert len(fresh.calls("b")) == 2
            assert len(fresh.calls("a")) == 3
        finally:
            fresh.close_reader()


async def test_a_reader_past_its_own_horizon_follows_a_compaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _aged_reader(tmp_path, monkeypatch, ["a", "b", "c"]) as (url, reader, asked):
        before = _rows(reader)
        reader.refresh()
        assert asked[-1] is not None
        # The merged unit takes its last unit's order, an hour before the reader's horizon:
        # no listing after it shows the marker; the checkpoint the run writes does.
        compact_all(url, grace_s=600)
        reader.refresh()
        assert _rows(reader) == before
        assert len(reader.calls("b")) == 3


async def test_a_checkpoint_there_but_not_used_keeps_the_reader_listing_every_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    def unusable_checkpoint(url: str) -> None:
        # A checkpoint readers cannot use (as one naming a unit whose marker a crash left
        # unwritten): the marker the next maintenance run writes takes an old order.
        dfs = DatasetFS(url)
        dfs.makedirs(CHECKPOINT.rsplit("/", 1)[0])
        dfs.put_all({CHECKPOINT: b'{"format": 1}'})

    async with _aged_reader(tmp_path, monkeypatch, ["a"], then=unusable_checkpoint) as found:
        _, reader, asked = found
        assert len(reader.calls("a")) == 3
        reader.refresh()
        reader.refresh()
        assert asked
        assert all(after is None for after in asked)
