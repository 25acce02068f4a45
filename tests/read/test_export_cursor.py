"""Incremental reads that cannot miss a rollout: `ExportCursor` against `since`.

The race: a pass reads the store; then a rollout becomes visible whose seal time (the sealing
proxy's clock) is earlier than anything that pass saw (a group commit still pending when it read,
another proxy's unit published later, a clock behind). `since` misses it, as documented; a cursor
takes it on the next pass, exactly once. Real SQLite files and Parquet datasets, each written to
between passes by a sink opened again, as a proxy's later commits land.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from capture_proxy import ExportCursor
from capture_proxy.cli import main
from capture_proxy.read.cursor import CURSOR_VERSION, CursorInvalid
from capture_proxy.read.export import export_store
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.base import StagingSink
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.support.sealing import put_sealed
from tests.support.sink_factories import Session


class Writer:
    """A store written in steps: each `commit` opens the sink, writes, and closes it."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.path = tmp_path / ("c.db" if kind == "sqlite" else "ds")
        self.url = f"{kind}:///{self.path}"
        self.sessions: dict[str, Session] = {}

    def _sink(self) -> StagingSink:
        if self.kind == "sqlite":
            return SQLiteSink(str(self.path))
        return ParquetSink(str(self.path))

    async def commit(
        self, *, staged: tuple[str, ...] = (), sealed: dict[str, int] | None = None
    ) -> None:
        """Stage two calls of each rollout in `staged` (open), seal each of `sealed` at its time."""
        sink = self._sink()
        try:
            for rollout_id in staged:
                s = self.sessions.setdefault(rollout_id, Session(rollout_id))
                for _ in range(2):
                    await sink.stage(s.next()[0])
                await sink.put_rollout(RolloutInfo(rollout_id, RolloutState.OPEN, False, 1))
            for rollout_id, at_ms in (sealed or {}).items():
                await put_sealed(
                    sink, RolloutInfo(rollout_id, RolloutState.SEALED, False, 1, at_ms)
                )
        finally:
            await sink.close()


@pytest.fixture(params=["sqlite", "parquet"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Writer:
    return Writer(request.param, tmp_path)


def passes(url: str, **read: object) -> list[str]:
    with open_store(url) as s:
        return [t.rollout_id for t in s.iter_trajectories(**read)]  # type: ignore[arg-type]


async def test_a_late_visible_seal_is_missed_by_since_and_taken_once_by_a_cursor(
    store: Writer,
) -> None:
    await store.commit(staged=("a", "b", "late"), sealed={"a": 1000, "b": 2000})
    cursor = ExportCursor()
    with open_store(store.url) as s:
        got = [t.rollout_id for t in s.iter_trajectories(cursor=cursor)]
    assert got == ["a", "b"]
    assert list(cursor) == ["a", "b"]
    # "late" was sealed at 1500 by its proxy's clock, but its seal became visible only now.
    await store.commit(sealed={"late": 1500})
    assert passes(store.url, since=2000) == ["b"]  # since: the time of the previous pass
    assert passes(store.url, since=2001) == []  # ...just after it: "late" is missed either way
    assert passes(store.url, cursor=cursor) == ["late"]
    assert passes(store.url, cursor=cursor) == []
    assert list(cursor) == ["a", "b", "late"]


async def test_export_store_with_a_cursor_exports_each_sealed_rollout_once(
    store: Writer, tmp_path: Path
) -> None:
    out = tmp_path / "seg.parquet"
    await store.commit(staged=("a", "late"), sealed={"a": 5000})
    cursor = ExportCursor()

    def export(**kw: object) -> list[str]:
        done = export_store(store.url, str(out), per="segment", **kw)  # type: ignore[arg-type]
        rows = [str(r) for r in pq.read_table(out).column("rollout_id").to_pylist()]
        assert len(set(rows)) == done.rollouts
        return sorted(set(rows))

    assert export(cursor=cursor) == ["a"]
    first = export_store(store.url, str(tmp_path / "all.parquet"))
    await store.commit(staged=("c",), sealed={"late": 10, "c": 6000})
    # Today's advice, `since` = the previous export's last seal time, misses "late".
    assert export(since=first.last_sealed_at_ms) == ["a", "c"]
    assert export(cursor=cursor) == ["c", "late"]
    assert export(cursor=cursor) == []
    assert sorted(cursor) == ["a", "c", "late"]


async def test_open_rollouts_taken_with_include_open_come_again_once_sealed(
    store: Writer,
) -> None:
    await store.commit(staged=("a",))
    cursor = ExportCursor()
    assert passes(store.url, cursor=cursor) == []  # open: left out, not taken
    assert passes(store.url, cursor=cursor, include_open=True) == ["a"]
    assert len(cursor) == 0  # what it read was not the whole rollout yet
    await store.commit(staged=("a",), sealed={"a": 1})
    traj = [t for t in open_store(store.url).iter_trajectories(cursor=cursor)]
    assert [(t.rollout_id, len(t.calls)) for t in traj] == [("a", 4)]
    assert list(cursor) == ["a"]


async def test_a_pass_stopped_early_has_taken_only_what_it_yielded(store: Writer) -> None:
    await store.commit(staged=("a", "b"), sealed={"a": 1, "b": 2})
    cursor = ExportCursor()
    with open_store(store.url) as s:
        it = s.iter_trajectories(cursor=cursor)
        assert next(it).rollout_id == "a"
        assert list(cursor) == ["a"]
    assert passes(store.url, cursor=cursor) == ["b"]


async def test_a_failed_export_leaves_the_cursor_unchanged(store: Writer, tmp_path: Path) -> None:
    await store.commit(staged=("a",), sealed={"a": 1})
    cursor = ExportCursor()
    with pytest.raises(FileNotFoundError):
        export_store(store.url, str(tmp_path / "no-such-dir" / "x.parquet"), cursor=cursor)
    assert len(cursor) == 0
    export_store(store.url, str(tmp_path / "x.parquet"), cursor=cursor)
    assert list(cursor) == ["a"]


async def test_the_cli_cursor_file_carries_the_passes(
    store: Writer, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    cursor_file = tmp_path / "train.cursor"
    await store.commit(staged=("a", "late"), sealed={"a": 5000})

    def export() -> list[str]:
        assert (
            main(["export", store.url, "-", "--per", "trajectory", "--cursor", str(cursor_file)])
            == 0
        )
        return [
            json.loads(line)["rollout_id"] for line in capsysbinary.readouterr().out.splitlines()
        ]

    assert export() == ["a"]
    assert json.loads(cursor_file.read_text()) == {"cursor_version": CURSOR_VERSION, "taken": ["a"]}
    await store.commit(sealed={"late": 1})
    assert export() == ["late"]
    assert export() == []
    assert "late" in ExportCursor.load(cursor_file)
    # A failed export (an unknown rollout) does not touch the cursor file.
    before = cursor_file.read_bytes()
    argv = ["export", store.url, "-", "--cursor", str(cursor_file), "--rollout", "nope"]
    assert main(argv) == 2
    assert cursor_file.read_bytes() == before


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("not json", "is not an export cursor (not JSON"),
        ('{"taken": []}', "is not an export cursor (no cursor_version)"),
        (
            '{"cursor_version": 99, "taken": []}',
            "version 99; this capture-proxy reads versions 1 to 2: upgrade capture-proxy",
        ),
        ('{"cursor_version": 1, "taken": [1]}', "taken is not a list of ids"),
    ],
)
async def test_a_file_that_is_not_a_cursor_is_refused_naming_the_flag(
    store: Writer,
    tmp_path: Path,
    content: str,
    says: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await store.commit(staged=("a",), sealed={"a": 1})
    bad = tmp_path / "bad.cursor"
    bad.write_text(content)
    assert main(["export", store.url, "-", "--cursor", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"capture-proxy export: --cursor: {bad} ")
    assert says in err
    assert bad.read_text() == content
    with pytest.raises(CursorInvalid, match=re.escape(says)):
        ExportCursor.load(bad)
