"""A crafted Parquet store whose page decompresses to gigabytes is refused before pyarrow
allocates it: a named limit (`MAX_PAGE_BYTES`, `MAX_READ_BYTES`), a clean error from every
trainer-facing read, and memory that stays small (the RSS figures are measured by
bench/fuzz_crafted_store.py, not here)."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capture_proxy.cli import main as cli_main
from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.read.export import export_store
from capture_proxy.read.reader import StoreCorrupted, open_store
from capture_proxy.sinks.base import StoreDamaged
from capture_proxy.sinks.parquet import _layout
from capture_proxy.sinks.parquet._bounds import MAX_PAGE_BYTES, MAX_READ_BYTES, CheckedReads
from capture_proxy.sinks.parquet._layout import open_parquet
from tests.read.test_tamper import write
from tests.support.parquet_bomb import bomb_file


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"key": ["a", "b"], "data": [b"x" * 100, b"y" * 10]}), path)
    return path


def _read(path: Path) -> pa.Table:
    with pa.OSFile(str(path)) as f:
        return open_parquet(f, path.name).read()


def test_a_page_past_the_page_limit_is_refused_before_it_is_decompressed(tmp_path: Path) -> None:
    path = _file(tmp_path)
    bomb_file(path, column="data", page_bytes=MAX_PAGE_BYTES + (8 << 20))
    assert path.stat().st_size < 1 << 20  # a few hundred KB that say 152 MiB
    with pytest.raises(StoreDamaged, match=r"decompresses to 159383552 bytes.*MAX_PAGE_BYTES"):
        _read(path)


def test_pages_past_the_read_limit_together_are_refused(tmp_path: Path) -> None:
    path = _file(tmp_path)
    pages = MAX_READ_BYTES // MAX_PAGE_BYTES + 1
    bomb_file(path, column="data", pages=pages, page_bytes=MAX_PAGE_BYTES)
    with pytest.raises(StoreDamaged, match="MAX_READ_BYTES"):
        _read(path)


def test_a_file_the_writer_wrote_reads_as_before(tmp_path: Path) -> None:
    path = _file(tmp_path)
    assert _read(path)["key"].to_pylist() == ["a", "b"]


async def test_a_bomb_in_a_parquet_store_is_a_clean_error_for_every_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The blobs file is read when the store is indexed: the store cannot be read at all,
    which every read says in one sentence naming the limit."""
    w = await write("parquet", tmp_path)
    (blobs,) = sorted((w.where / "blobs").glob("*.parquet"))[:1]
    bomb_file(blobs, column="data", page_bytes=MAX_PAGE_BYTES + (8 << 20))
    with open_store(w.url) as store:
        with pytest.raises((StoreCorrupted, StoreDamaged), match="MAX_PAGE_BYTES"):
            store.verify()
        with pytest.raises((StoreCorrupted, StoreDamaged), match="MAX_PAGE_BYTES"):
            list(store.iter_trajectories())
    out = io.StringIO()
    assert inspect_main([w.url, "--verify"], stdout=out) in (1, 2)
    assert "MAX_PAGE_BYTES" in out.getvalue() + capsys.readouterr().err
    with pytest.raises(StoreDamaged, match="MAX_PAGE_BYTES"):
        export_store(w.url, str(tmp_path / "x.parquet"))
    assert cli_main(["export", w.url, str(tmp_path / "y.parquet")]) == 2  # cannot be opened
    assert "MAX_PAGE_BYTES" in capsys.readouterr().err


def test_the_memo_of_checked_reads_keeps_the_latest_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy reads every unit of its store over weeks: the memo of reads whose pages were
    checked holds the most recently used ones, not every file ever read."""
    memo = CheckedReads(limit=3)
    monkeypatch.setattr(_layout, "_CHECKED", memo)
    paths = []
    for i in range(5):
        path = tmp_path / f"t{i}.parquet"
        pq.write_table(pa.table({"key": [str(i)]}), path)
        paths.append(path)
        with pa.OSFile(str(path)) as f:
            open_parquet(f, path.name)
    assert len(memo) == 3
    assert not memo.seen(("t0.parquet", paths[0].stat().st_size, None, None))
    assert memo.seen(("t4.parquet", paths[4].stat().st_size, None, None))
    # One that fell out is checked again when read again: a bomb under its name is refused.
    bomb_file(paths[0], column="key", page_bytes=MAX_PAGE_BYTES + 1)
    with pytest.raises(StoreDamaged, match="MAX_PAGE_BYTES"):
        _read(paths[0])
    assert len(memo) == 3
