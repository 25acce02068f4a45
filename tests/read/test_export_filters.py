"""What an export takes and how it lays it out: `rollouts`, `group` and `since` (seal time), a
GRPO group's rollouts next to each other, the driver's outcome on every row (here from a `Store`
that reports outcomes, as the store does once drivers report them), row groups sized for scans,
file-level metadata; the same filters on `Store.iter_trajectories`; `export STORE -`.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from capture_proxy.cli import main
from capture_proxy.read.export import export_store, read_export_metadata
from capture_proxy.read.reader import Store, open_store
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.base import StagingSink
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.registry import open_source
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.support.sealing import put_sealed
from tests.support.sink_factories import Session

#: Rollouts in store order, each with its group, reward and seal time (ms). GRPO groups g1 and
#: g2 interleave in time, as rollouts of concurrent groups finish.
ROLLOUTS = [
    ("r0", "g1", 1.0, 1000),
    ("r1", "g2", 0.0, 1001),
    ("r2", "g1", 0.5, 1002),
    ("r3", None, None, 1003),
    ("r4", "g2", {"pass": 1.0, "style": 0.25}, 5000),
]


@pytest.fixture(params=["sqlite", "parquet"])
async def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        sink: StagingSink = SQLiteSink(str(tmp_path / "c.db"))
        where = f"sqlite:///{tmp_path / 'c.db'}"
    else:
        sink = ParquetSink(str(tmp_path / "ds"))
        where = f"parquet:///{tmp_path / 'ds'}"
    for rollout_id, group, reward, sealed_at in ROLLOUTS:
        s = Session(rollout_id)
        for _ in range(2):
            await sink.stage(s.next()[0])
        outcomes = () if group is None else (RolloutOutcome(reward, group),)
        await put_sealed(
            sink,
            RolloutInfo(
                rollout_id, RolloutState.SEALED, False, 1, sealed_at, outcome_history=outcomes
            ),
        )
    await sink.close()
    return where


def judged(url: str) -> Store:
    """The store, whose rollouts carry the outcomes of `ROLLOUTS` as drivers report them."""
    return Store(open_source(url))


def test_rows_carry_the_outcome_and_groups_are_adjacent(url: str, tmp_path: Path) -> None:
    out = tmp_path / "traj.parquet"
    with judged(url) as store:
        done = export_store(store, str(out), per="trajectory")
    assert done.last_sealed_at_ms == 5000
    rows = pq.read_table(out).to_pylist()
    # g1 at its first rollout's place, then g2, then the ungrouped r3 in store order.
    assert [(r["rollout_id"], r["group_id"]) for r in rows] == [
        ("r0", "g1"),
        ("r2", "g1"),
        ("r1", "g2"),
        ("r4", "g2"),
        ("r3", None),
    ]
    by_id = {r["rollout_id"]: r for r in rows}
    assert (by_id["r0"]["reward"], by_id["r0"]["reward_components"]) == (1.0, None)
    assert by_id["r3"]["reward"] is None
    # An object reward: the sum of its parts as the scalar, the parts as {name, value}.
    assert by_id["r4"]["reward"] == 1.25
    assert by_id["r4"]["reward_components"] == [
        {"name": "pass", "value": 1.0},
        {"name": "style", "value": 0.25},
    ]
    assert [by_id[r]["sealed_at_ms"] for r in ("r0", "r4")] == [1000, 5000]
    assert {r["num_turns"] for r in rows} == {2}


def test_filters_by_rollout_group_and_seal_time(url: str, tmp_path: Path) -> None:
    out = tmp_path / "seg.parquet"

    def ids(**filters: object) -> list[str]:
        with judged(url) as store:
            export_store(store, str(out), per="segment", **filters)  # type: ignore[arg-type]
        return [str(r) for r in pq.read_table(out).column("rollout_id").to_pylist()]

    assert ids(rollouts=["r3", "r1"]) == ["r1", "r3"]
    assert ids(group="g2") == ["r1", "r4"]
    assert ids(group=["g2", "g1"]) == ["r0", "r2", "r1", "r4"]
    # An incremental trainer: the previous export saw up to 1002; r3 and r4 were sealed since.
    assert ids(since=1003) == ["r3", "r4"]
    assert ids(since=datetime.fromtimestamp(5, tz=UTC)) == ["r4"]
    assert ids(since=5001) == []
    with judged(url) as store, pytest.raises(KeyError, match="no rollout 'nope'"):
        export_store(store, str(out), rollouts=["r0", "nope"])


def test_iter_trajectories_takes_the_same_filters(url: str) -> None:
    with judged(url) as store:
        got = [(t.rollout_id, t.group_id, t.reward) for t in store.iter_trajectories(group="g1")]
        assert got == [("r0", "g1", 1.0), ("r2", "g1", 0.5)]
        later = store.iter_trajectories(since=datetime(1970, 1, 1, 0, 0, 1, 2000))
        assert [t.rollout_id for t in later] == ["r2", "r3", "r4"]  # sealed at 1002 ms or later
        assert store.trajectory("r4").reward_components == {"pass": 1.0, "style": 0.25}
    with open_store(url) as plain:  # r3 got no outcome: none on its trajectory
        traj = plain.trajectory("r3")
        assert (traj.reward, traj.reward_components, traj.group_id) == (None, None, None)
        assert traj.to_dict()["reward"] is None


def test_row_groups_are_sized_for_scans_and_the_file_says_what_it_is(
    url: str, tmp_path: Path
) -> None:
    out = tmp_path / "calls.parquet"
    export_store(url, str(out), per="call")
    meta = pq.read_metadata(out)
    assert (meta.num_rows, meta.num_row_groups) == (10, 1)  # not one group per rollout
    export_store(url, str(out), per="call", row_group_bytes=1)
    assert pq.read_metadata(out).num_row_groups == len(ROLLOUTS)
    from importlib.metadata import version

    assert read_export_metadata(str(out)) == {
        "export_format_version": "2",
        "capture_proxy_version": version("capture-proxy"),
        "store": url,
        "per": "call",
        "tokenizer_fingerprints": json.dumps(["f" * 64]),
    }


def test_export_to_stdout_writes_json_lines(
    url: str, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    assert main(["export", url, "-", "--per", "segment", "--rollout", "r1", "--json"]) == 0
    out, err = capsysbinary.readouterr()
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (row["rollout_id"], row["segment_index"]) == ("r1", 0)
    assert row["response_mask"][0] == 1
    summary = json.loads(err)  # the summary goes to stderr, the rows alone to stdout
    assert (summary["out"], summary["rows"], summary["attachments_out"]) == ("-", 1, None)

    # JSON values nest: a call's request is an object, not JSON text.
    assert main(["export", url, "-", "--since", "1970-01-01T00:00:05Z"]) == 0
    out, err = capsysbinary.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["rollout_id"] for r in rows] == ["r4", "r4"]
    assert rows[0]["request"]["messages"][0]["role"] == "system"
    assert err.startswith(b"wrote 2 row(s) of 1 rollout(s) to -")

    # The format follows the name; Parquet to stdout is refused, naming what to do instead.
    assert main(["export", url, str(tmp_path / "x.jsonl"), "--rollout", "r0"]) == 0
    assert json.loads((tmp_path / "x.jsonl").read_bytes().splitlines()[0])["rollout_id"] == "r0"
    capsysbinary.readouterr()
    assert main(["export", url, "-", "--format", "parquet"]) == 2
    out, err = capsysbinary.readouterr()
    assert out == b""
    assert err.startswith(b"capture-proxy export: Parquet cannot be written to stdout")
    assert b"--format jsonl" in err
    assert main(["export", url, "-", "--rollout", "nope"]) == 2
    assert b"no rollout 'nope'" in capsysbinary.readouterr().err


def test_a_bad_since_is_a_usage_error_naming_the_flag(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["export", url, "-", "--since", "yesterday"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--since" in err
    assert "ISO 8601" in err
