"""Trajectories of token-in records (built directly: the flow is tested apart): linear by
construction, breaks with the reason the call recorded, the proxy's inserted tokens listed and
never trained on, per-token engine versions from generate's weight spans."""

from __future__ import annotations

from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from capture_proxy.read.export import export_store
from capture_proxy.read.trajectory import Break, trajectory_from_records
from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.schemas.token_in_extras import SegmentBreak, token_in_extras
from tests.read.test_export_segments import stored
from tests.read.test_trajectory import call


def token_in(
    record: StagedCallRecord,
    *,
    said: SegmentBreak | None = None,
    divergence: int | None = None,
    bridges: list[tuple[int, int, str]] | None = None,
) -> StagedCallRecord:
    extras: dict[str, Any] = token_in_extras(said, divergence)
    return seal_record(replace(record, token_in=True, extras=extras, bridge_spans=bridges or ()))


def test_token_in_calls_make_one_segment_with_the_bridges_listed_and_untrained() -> None:
    # Call 1's completion [5, 6] was cut by length: the proxy added the end of turn (7) and the
    # template's next-user text follows (8, 9).
    records = [
        token_in(
            call(0, [1, 2, 3, 4], [5, 6], spans=[("v1", 0, 2)]), said=SegmentBreak("no_prior")
        ),
        token_in(
            call(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12], spans=[("v1", 0, 1), ("v2", 1, 3)]),
            divergence=6,
            bridges=[(6, 7, "end_of_turn")],
        ),
    ]
    traj = trajectory_from_records("r", records)
    assert traj.token_ids.tolist() == list(range(1, 13))
    assert len(traj.segments) == 1
    assert traj.breaks == []
    assert traj.bridge_spans == [(6, 7, "end_of_turn")]
    assert traj.token_ids[6] == 7
    assert traj.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    # The call straddled a weight update: exact per-token engine versions.
    assert traj.engine_weight_versions == [None] * 4 + ["v1", "v1"] + [None] * 3 + [
        "v1",
        "v2",
        "v2",
    ]
    assert traj.to_dict()["bridge_spans"] == [[6, 7, "end_of_turn"]]


def test_a_token_in_call_that_sent_the_plain_rendering_breaks_with_its_reason() -> None:
    said = SegmentBreak("history_edited", "message 1 differs from what was sent")
    records = [
        token_in(call(0, [1, 2], [3])),
        token_in(
            call(1, [1, 9, 9, 4], [5], spans=[("v1", 0, 1)]), said=said, bridges=[(3, 4, "x")]
        ),
    ]
    traj = trajectory_from_records("r", records)
    assert traj.breaks == [Break("c1", 3, "history_edited", said)]
    assert traj.drift == []  # not drift: the proxy knew, and said why
    assert [s.call_ids for s in traj.segments] == [("c0",), ("c1",)]
    # A new segment re-states the whole prompt: its bridge is at the prompt's own offset.
    assert traj.bridge_spans == [(6, 7, "x")]
    assert traj.to_dict()["breaks"] == [
        {
            "call_id": "c1",
            "position": 3,
            "reason": "history_edited",
            "detail": {"reason": "history_edited", "detail": said.detail},
        }
    ]


def test_a_recorded_break_whose_prompt_still_extends_keeps_the_segment() -> None:
    # The plain rendering happened to extend the sequence: the tokens are those the model saw.
    records = [
        token_in(call(0, [1, 2], [3])),
        token_in(call(1, [1, 2, 3, 4], [5]), said=SegmentBreak("tools_changed")),
    ]
    traj = trajectory_from_records("r", records)
    assert traj.breaks == []
    assert len(traj.segments) == 1


def test_the_extras_of_a_plain_record_are_not_read_as_a_token_in_break() -> None:
    plain = call(1, [1, 9], [5])
    plain = seal_record(replace(plain, extras=token_in_extras(SegmentBreak("history_edited"), 1)))
    traj = trajectory_from_records("r", [call(0, [1, 2], [3]), plain])
    assert [b.reason for b in traj.breaks] == ["drift"]


def test_a_token_in_call_that_does_not_extend_and_says_nothing_is_drift() -> None:
    records = [token_in(call(0, [1, 2], [3])), token_in(call(1, [1, 9], [5]))]
    traj = trajectory_from_records("r", records)
    assert [b.reason for b in traj.breaks] == ["drift"]
    assert traj.drift[0].position == 1


def test_bridges_before_the_new_tokens_are_not_listed_twice() -> None:
    # Call 1 repeats call 0's bridge (inside the shared prefix) and adds one of its own.
    first = token_in(call(0, [1, 2, 3], [4]), bridges=[(1, 2, "a")])
    second = token_in(call(1, [1, 2, 3, 4, 5, 6], [7]), bridges=[(1, 2, "a"), (4, 5, "b")])
    traj = trajectory_from_records("r", [first, second])
    assert traj.bridge_spans == [(1, 2, "a"), (4, 5, "b")]
    assert array("i", [traj.token_ids[1], traj.token_ids[4]]).tolist() == [2, 5]


async def test_exports_carry_the_token_in_breaks_and_bridges(tmp_path: Path) -> None:
    said = SegmentBreak("tools_changed", "a tool was added")
    records = [
        token_in(call(0, [1, 2, 3], [4]), bridges=[(1, 2, "a")]),
        token_in(call(1, [1, 2, 3, 4, 5, 6], [7]), bridges=[(4, 5, "end_of_turn")]),
        token_in(call(2, [1, 8, 8], [9]), said=said),
    ]
    url = await stored("sqlite", tmp_path, *records)
    out = tmp_path / "traj.parquet"
    export_store(url, str(out), per="trajectory")
    [row] = pq.read_table(out).to_pylist()
    assert row["bridge_spans"] == [
        {"start": 1, "end": 2, "reason": "a"},
        {"start": 4, "end": 5, "reason": "end_of_turn"},
    ]
    assert [b["reason"] for b in row["breaks"]] == ["tools_changed"]
    assert [row["loss_mask"][b["start"]] for b in row["bridge_spans"]] == [0, 0]
    segments = tmp_path / "seg.parquet"
    export_store(url, str(segments), per="segment")
    assert [r["break_reason"] for r in pq.read_table(segments).to_pylist()] == [
        None,
        "tools_changed",
    ]
