"""`export --per segment`: one row per sequence the model saw, split into prompt and response as
RL trainers take it; the driver's outcome and the rollout's facts on every row; the images rows
refer to, once per export; vLLM's media spans placed in the rows' token ids. Both stores.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from capture_proxy.read.export import attachments_path, export_store
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import RolloutInfo, RolloutState, StagedCallRecord
from capture_proxy.sinks.base import StagingSink
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.read.test_export import fill, listing, seal
from tests.read.test_trajectory import call
from tests.support.sealing import put_sealed
from tests.support.sink_factories import Session, image, png_bytes


def _writer(kind: str, tmp_path: Path) -> tuple[str, StagingSink]:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'capture.db'}", SQLiteSink(str(tmp_path / "capture.db"))
    return f"parquet:///{tmp_path / 'ds'}", ParquetSink(str(tmp_path / "ds"))


@pytest.fixture(params=["sqlite", "parquet"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def stored(kind: str, tmp_path: Path, *records: StagedCallRecord) -> str:
    url, sink = _writer(kind, tmp_path)
    for r in records:
        assert (await sink.stage(r)).coords is not None
    await seal(sink, *dict.fromkeys(r.rollout_id for r in records))
    await sink.close()
    return url


async def test_worked_example_per_segment(kind: str, tmp_path: Path) -> None:
    # docs/trajectories.md's worked example: c1 and c2 extend each other (13 is c2's tool
    # output, inside segment 0's response at mask 0); c3 drifts and opens segment 1.
    url = await stored(
        kind,
        tmp_path,
        call(0, [1, 2, 3], [4], tools=False),
        call(1, [10, 11, 12], [20, 21], wv=1),
        call(2, [10, 11, 12, 20, 21, 13], [22, 23], wv=1),
        call(3, [10, 11, 12, 20, 21, 13, 22, 99, 14], [24], wv=2),
    )
    out = tmp_path / "seg.parquet"
    done = export_store(url, str(out), per="segment")
    assert (done.rows, done.rollouts) == (2, 1)
    seg0, seg1 = pq.read_table(out).to_pylist()
    assert seg0 | {"sealed_at_ms": 0} == {
        "rollout_id": "r",
        "group_id": None,
        "reward": None,
        "reward_components": None,
        "state": "sealed",
        "poisoned": False,
        "n_failures": 0,
        "sealed_at_ms": 0,
        "num_turns": 3,  # c1, c2, c3: the title call is apart
        "segment_index": 0,
        "n_segments": 2,
        "break_reason": None,
        "call_ids": ["c1", "c2"],
        "finish_reason": "stop",
        "prompt_ids": [10, 11, 12],
        "response_ids": [20, 21, 13, 22, 23],
        "response_mask": [1, 1, 0, 1, 1],
        "response_logprobs": [-0.125, -0.25, 0.0, -0.125, -0.25],
        "response_weight_versions": [1, 1, 0, 1, 1],
        "response_engine_weight_versions": [None] * 5,
        "attachment_shas": [],
        "attachment_media_types": [],
        "media_spans": [],
    }
    assert seg1["sealed_at_ms"] == seg0["sealed_at_ms"] == 2  # seal() seals at 2 ms
    assert (seg1["segment_index"], seg1["break_reason"], seg1["call_ids"]) == (1, "drift", ["c3"])
    assert seg1["prompt_ids"] == [10, 11, 12, 20, 21, 13, 22, 99, 14]
    assert (seg1["response_ids"], seg1["response_mask"]) == ([24], [1])
    assert (seg1["response_logprobs"], seg1["response_weight_versions"]) == ([-0.125], [2])


async def test_segments_cover_each_trajectory_exactly(kind: str, tmp_path: Path) -> None:
    url, sink = _writer(kind, tmp_path)
    await fill(sink)
    await seal(sink, "ra", "rb")
    await sink.close()
    out = tmp_path / "seg.parquet"
    export_store(url, str(out), per="segment")
    rows = pq.read_table(out).to_pylist()
    with open_store(url) as store:
        for traj in store.iter_trajectories():
            mine = [r for r in rows if r["rollout_id"] == traj.rollout_id]
            assert [r["segment_index"] for r in mine] == list(range(len(traj.segments)))
            for row, seg in zip(mine, traj.segments, strict=True):
                tokens = traj.token_ids[seg.start : seg.end].tolist()
                assert row["prompt_ids"] + row["response_ids"] == tokens
                cut = seg.start + len(row["prompt_ids"])
                assert traj.loss_mask[cut] == 1  # the response starts at a generated token
                assert set(traj.loss_mask[seg.start : cut]) <= {0}
                assert row["response_mask"] == traj.loss_mask[cut : seg.end].tolist()
                lps = array("f", row["response_logprobs"])
                assert lps.tobytes() == traj.logprobs[cut : seg.end].tobytes()
                assert row["num_turns"] == len(traj.calls)
                assert row["call_ids"] == list(seg.call_ids)
            assert [r["break_reason"] for r in mine[1:]] == [b.reason for b in traj.breaks]
    assert {r["rollout_id"]: r["n_segments"] for r in rows} == {"ra": 1, "rb": 2}


async def test_images_are_exported_once_beside_the_rows(kind: str, tmp_path: Path) -> None:
    # Both sessions show the same first image (re-sent on every call); ra shows a second later.
    url, sink = _writer(kind, tmp_path)
    shared = image("shared")
    later = image("later")
    sessions = {r: Session(r, image=shared) for r in ("ra", "rb")}
    for turn in range(3):
        for s in sessions.values():
            extra = later if (s.rollout_id == "ra" and turn == 1) else None
            r, atts = s.next(new_image=extra)
            assert (await sink.stage(r, attachments=atts)).coords is not None
    await seal(sink, "ra", "rb")
    await sink.close()
    for per in ("segment", "trajectory", "call"):
        out = tmp_path / f"{per}.parquet"
        done = export_store(url, str(out), per=per)
        side = tmp_path / f"{per}.attachments.parquet"
        assert done.attachments_out == attachments_path(str(out)) == str(side)
        assert done.attachments == 2
        table = pq.read_table(side).to_pylist()
        assert {(a["sha256"], a["media_type"], a["size"]) for a in table} == {
            (shared.sha256, "image/png", len(png_bytes("shared"))),
            (later.sha256, "image/png", len(png_bytes("later"))),
        }
        assert {a["sha256"]: a["data"] for a in table}[later.sha256] == png_bytes("later")
        rows = pq.read_table(out).to_pylist()
        shas = {r["rollout_id"]: r["attachment_shas"] for r in rows}  # the last row of each
        assert shas == {"ra": [shared.sha256, later.sha256], "rb": [shared.sha256]}
    # The same export name without images: the earlier images file goes with the rows it served.
    again = export_store(url, str(tmp_path / "segment.parquet"), per="segment", rollouts=["rb"])
    assert (again.attachments, again.attachments_out) == (
        1,
        str(side.parent / "segment.attachments.parquet"),
    )
    none = export_store(url, str(tmp_path / "segment.parquet"), per="segment", attachments=False)
    assert (none.attachments, none.attachments_out) == (0, None)
    assert not (tmp_path / "segment.attachments.parquet").exists()
    assert [name for name in listing(tmp_path) if name.endswith(".tmp")] == []


async def test_media_spans_are_placed_in_the_rows_token_ids(kind: str, tmp_path: Path) -> None:
    # vLLM reports an image's placeholder positions in each call's prompt; every later call of
    # the session re-reports the same span. A segment lists it once, at offset 0 (every call of
    # a segment starts at its first token); a trajectory row at its segment's start.
    url, sink = _writer(kind, tmp_path)
    s = Session("rm", image=image("m"))
    span = {"start": 3, "end": 10, "modality": "image"}
    for turn in range(4):
        r, atts = s.next(extras={"media_spans": [span]}, drift_at=20 if turn == 2 else None)
        assert (await sink.stage(r, attachments=atts)).coords is not None
    await seal(sink, "rm")
    await sink.close()
    seg = tmp_path / "seg.parquet"
    export_store(url, str(seg), per="segment")
    rows = pq.read_table(seg).to_pylist()
    assert [r["media_spans"] for r in rows] == [
        [{"call_id": "rm-c0", "offset": 0, "span": '{"end":10,"modality":"image","start":3}'}],
        [{"call_id": "rm-c2", "offset": 0, "span": '{"end":10,"modality":"image","start":3}'}],
    ]
    traj = tmp_path / "traj.jsonl"
    export_store(url, str(traj), per="trajectory")
    (row,) = [json.loads(line) for line in traj.read_bytes().splitlines()]
    second = row["segments"][1]["start"]
    assert row["media_spans"] == [
        {"call_id": "rm-c0", "offset": 0, "span": span},  # nested in JSON Lines
        {"call_id": "rm-c2", "offset": second, "span": span},
    ]


async def test_a_rollout_sealed_without_a_header_time_exports_null(tmp_path: Path) -> None:
    sink = SQLiteSink(str(tmp_path / "c.db"))
    s = Session("r0")
    await sink.stage(s.next()[0])
    await put_sealed(sink, RolloutInfo("r0", RolloutState.SEALED, False, 1, None))
    await sink.close()
    out = tmp_path / "o.parquet"
    done = export_store(f"sqlite:///{tmp_path / 'c.db'}", str(out), per="segment")
    assert done.last_sealed_at_ms is None
    assert pq.read_table(out).column("sealed_at_ms").to_pylist() == [None]
