"""The registry of store kinds: one place decides what a store URL opens, whether gc and
compaction apply, and which local folder the disk floor guards. Built-in kinds register like a
plugin's; each one has its row in docs/storage.md."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.cli import main
from capture_proxy.read.reader import open_store
from capture_proxy.sinks import (
    MemorySink,
    StagingSink,
    StagingSource,
    StoreError,
    StoreKind,
    StoreURL,
    UnsupportedStoreOperation,
    register_store_kind,
    store_kinds,
)
from capture_proxy.sinks.registry import (
    compact_store,
    gc_store,
    open_sink,
    open_source,
    resolve_store,
    store_local_dir,
    unregister_store_kind,
)
from tests.support import ROOT
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user


class TapeSink(MemorySink):
    """A plugin's sink: a `MemorySink` that also counts what it was asked to stage."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.staged = 0

    async def stage(self, record: Any, **kwargs: Any) -> Any:
        self.staged += 1
        return await super().stage(record, **kwargs)


class TapeKind(StoreKind):
    """``tape://name``: in-process tapes, kept by the kind. No gc, no compaction, no disk."""

    name = "tape"
    label = "tape"
    url_schemes = ("tape",)

    def __init__(self) -> None:
        self.tapes: dict[str, TapeSink] = {}

    def open_sink(self, store: StoreURL, **options: Any) -> StagingSink:
        if store.url not in self.tapes:
            self.tapes[store.url] = TapeSink(store.url, **options)
        return self.tapes[store.url]

    def open_source(self, store: StoreURL, *, cache_bytes: int | None = None) -> StagingSource:
        if store.url not in self.tapes:
            raise StoreError(f"no tape named {store.url}")
        return self.tapes[store.url]


@pytest.fixture
def tape() -> Iterator[TapeKind]:
    kind = register_store_kind(TapeKind())
    assert isinstance(kind, TapeKind)
    try:
        yield kind
    finally:
        unregister_store_kind("tape")


def _documented_kinds() -> list[str]:
    """The kind names in the first column of the table under docs/storage.md's "Store kinds"."""
    text = (ROOT / "docs" / "storage.md").read_text()
    match = re.search(r"^## Store kinds\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, 'docs/storage.md has no "## Store kinds" section'
    return re.findall(r"^\| `([a-z0-9_]+)` \|", match.group(1), re.M)


def test_every_registered_kind_is_documented() -> None:
    documented = _documented_kinds()
    registered = [k.name for k in store_kinds()]
    assert registered[:3] == ["sqlite", "parquet", "memory"]
    assert documented == registered, "docs/storage.md: one table row per store kind"


async def test_a_plugin_kind_is_opened_by_url_everywhere(tape: TapeKind, tmp_path: Path) -> None:
    kind, store = resolve_store("tape://run")
    assert kind is tape
    assert store == StoreURL("tape", "tape://run", "tape://run")
    assert store_local_dir("tape://run") is None  # the disk floor skips it
    with pytest.raises(StoreError, match="no tape named tape://run"):
        open_source("tape://run")

    # The proxy opens its store by URL through the registry, and guards no disk for it.
    sink = open_sink("tape://run")
    assert isinstance(sink, TapeSink)
    assert open_sink("tape://run") is sink
    p = await start_proxy(tmp_path, sink=sink, store="tape://run", min_free_disk_mb=1 << 40)
    try:
        resp = await p.chat(chat_body(user("hello tape")), rollout="r1")
        assert resp.status == 200, await resp.text()
    finally:
        await stop_proxy(p)
    assert sink.staged == 1

    # A trainer reads it back by URL.
    with open_store("tape://run") as reader:
        [record] = reader.calls("r1", include_open=True)
        reader.verify()
    assert record.rollout_id == "r1"
    assert open_source("tape://run") is sink


def test_gc_and_compact_name_the_kind_that_has_neither(
    tape: TapeKind, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(
        UnsupportedStoreOperation,
        match=r"^gc applies to SQLite and Parquet stores; tape://x is a tape store$",
    ):
        gc_store("tape://x", older_than_ms=1, now_ms=2)
    with pytest.raises(
        UnsupportedStoreOperation,
        match=r"^compaction applies to Parquet stores; memory://x lives in a process's memory$",
    ):
        compact_store("memory://x")

    db = tmp_path / "x.db"
    assert main(["compact", str(db)]) == 2
    assert capsys.readouterr().err == (
        f"capture-proxy compact: compaction applies to Parquet stores; sqlite:///{db} is a "
        "SQLite store\n"
    )
    assert main(["gc", "tape://x", "--older-than", "1d"]) == 2
    assert capsys.readouterr().err == (
        "capture-proxy gc: gc applies to SQLite and Parquet stores; tape://x is a tape store\n"
    )
    assert not db.exists()  # refused before anything was opened


def test_an_unknown_scheme_lists_the_known_kinds(tape: TapeKind) -> None:
    with pytest.raises(StoreError) as caught:
        open_sink("ftp://host/store")
    assert str(caught.value) == (
        "store URL 'ftp://host/store': unknown scheme 'ftp'; the known store kinds are "
        "sqlite (sqlite:///); parquet (parquet:///, file://, s3://, gs://, gcs://, hdfs://, "
        "abfs://, az://); memory (memory://); remote (http://, https://); tape (tape://)"
    )


def test_a_kind_cannot_take_another_kinds_urls(tape: TapeKind) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_store_kind(TapeKind())

    class Other(StoreKind):
        name = "other"
        label = "other"
        url_schemes = ("s3", "tape")

    with pytest.raises(
        ValueError,
        match=r"^store kind other: already taken: s3 by parquet, tape by tape$",
    ):
        register_store_kind(Other())

    class Paths(StoreKind):
        name = "paths"
        label = "paths"
        path_schemes = ("paths",)
        plain_paths = True

    with pytest.raises(
        ValueError, match=r"^store kind paths: already taken: plain paths by parquet$"
    ):
        register_store_kind(Paths())
    assert [k.name for k in store_kinds()] == ["sqlite", "parquet", "memory", "remote", "tape"]


def test_each_kind_picks_its_local_folder(tmp_path: Path) -> None:
    assert store_local_dir(f"sqlite:///{tmp_path}/a/x.db") == str(tmp_path / "a")
    assert store_local_dir(str(tmp_path / "x.sqlite")) == str(tmp_path)
    assert store_local_dir(f"parquet:///{tmp_path}/ds") == str(tmp_path / "ds")
    assert store_local_dir(str(tmp_path / "ds")) == str(tmp_path / "ds")
    assert store_local_dir("s3://bucket/prefix") is None
    assert store_local_dir("memory://x") is None


def test_sqlite_through_the_registry_never_imports_pyarrow(tmp_path: Path) -> None:
    # A trainer on SQLite: every kind resolves, a SQLite store is written, read and collected.
    code = f"""
import asyncio, sys
from capture_proxy.sinks.registry import gc_store, open_sink, open_source, resolve_store
for url in ("x.db", "parquet:///ds", "s3://b/p", "memory://m"):
    resolve_store(url)
url = "sqlite:///{tmp_path / "t.db"}"
asyncio.run(open_sink(url).close())
open_source(url).close_reader()
gc_store(url, older_than_ms=0, now_ms=1)
print(sorted(m for m in ("pyarrow", "aiohttp") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
