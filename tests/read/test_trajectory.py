"""Trajectories: linearization, loss mask, logprobs, per-token call index and weight version,
drift and segments, retries, calls kept apart; the worked example of docs/trajectories.md; the
same trajectory from every sink.
"""

from __future__ import annotations

from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.read.reader import Store
from capture_proxy.read.trajectory import (
    Break,
    Drift,
    Segment,
    build_trajectory,
    trajectory_from_records,
)
from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def call(
    i: int,
    prompt: list[int],
    completion: list[int],
    *,
    rollout: str = "r",
    tools: bool = True,
    wv: int = 0,
    retry_of: str | None = None,
    text: str | None = None,
    spans: list[tuple[str, int, int]] | None = None,
) -> StagedCallRecord:
    """A sealed record: call id ``c<i>``, seq `i`, logprobs -(k+1)/8 for completion token k."""
    request: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": text or f"turn {i}"}],
    }
    if tools:
        request["tools"] = TOOLS
    return seal_record(
        StagedCallRecord(
            rollout_id=rollout,
            call_id=f"c{i}",
            seq=i,
            model="m",
            finish_reason="stop",
            request=request,
            response={"role": "assistant", "content": f"answer {i}"},
            prompt_token_ids=array("i", prompt),
            completion_token_ids=array("i", completion),
            completion_logprobs=array("f", [-(k + 1) / 8 for k in range(len(completion))]),
            retry_of=retry_of,
            weight_version=wv,
            weight_spans=spans or (),
        )
    )


async def memory_with(*records: StagedCallRecord) -> MemorySink:
    sink = MemorySink()
    for r in records:
        assert (await sink.stage(r)).coords is not None
    return sink


# -- the worked example of docs/trajectories.md --------------------------------------------------


async def test_worked_example() -> None:
    # c0: OpenCode's title call (no tools). c1 and c2 extend each other; c3 was re-rendered
    # (the template re-serialized c2's tool arguments), so it drifts at position 7.
    title = call(0, [1, 2, 3], [4], tools=False)
    c1 = call(1, [10, 11, 12], [20, 21], wv=1)  # full: 10 11 12 20 21
    c2 = call(2, [10, 11, 12, 20, 21, 13], [22, 23], wv=1)  # extends c1 by one prompt token
    c3 = call(3, [10, 11, 12, 20, 21, 13, 22, 99, 14], [24], wv=2)  # 99 where c2 made 23
    traj = build_trajectory(await memory_with(title, c1, c2, c3), "r")

    assert traj.calls == ["c1", "c2", "c3"]
    assert traj.apart == ["c0"]
    assert traj.retries_skipped == []
    assert traj.token_ids.tolist() == [
        *[10, 11, 12, 20, 21, 13, 22, 23],  # segment 0: c2's prompt + completion
        *[10, 11, 12, 20, 21, 13, 22, 99, 14, 24],  # segment 1: c3's prompt + completion
    ]
    assert traj.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1] + [0] * 9 + [1]
    assert traj.call_index.tolist() == [0, 0, 0, 0, 0, 1, 1, 1] + [2] * 10
    # Tokens c1 and c2 generated keep weight version 1, even re-stated as c3's prompt.
    seg0_versions = [0, 0, 0, 1, 1, 0, 1, 1]
    seg1_versions = [0, 0, 0, 1, 1, 0, 1, 0, 0, 2]
    assert traj.weight_versions.tolist() == seg0_versions + seg1_versions
    assert traj.logprobs.tolist() == [0, 0, 0, -0.125, -0.25, 0, -0.125, -0.25] + [0] * 9 + [-0.125]
    assert traj.segments == [Segment(0, 8, ("c1", "c2")), Segment(8, 18, ("c3",))]
    assert traj.drift == [Drift("c3", "c2", 7, 8, 9)]
    assert traj.breaks == [Break("c3", 8, "drift", Drift("c3", "c2", 7, 8, 9))]
    # No record says which engine weights sampled its tokens: unknown everywhere.
    assert traj.engine_weight_versions == [None] * 18


async def test_engine_weight_versions_follow_weight_spans_like_weight_versions() -> None:
    # c1 straddles an engine update: its first token by "w1", the second by "w2". c2 reports no
    # spans (unknown). c3 drifts: its re-stated prompt keeps the versions of the shared prefix.
    c1 = call(1, [10, 11], [20, 21], wv=1, spans=[("w1", 0, 1), ("w2", 1, 2)])
    c2 = call(2, [10, 11, 20, 21, 13], [22], wv=1)
    c3 = call(3, [10, 11, 20, 99], [24, 25], wv=2, spans=[("w3", 0, 2)])
    traj = build_trajectory(await memory_with(c1, c2, c3), "r")
    seg0 = [None, None, "w1", "w2", None, None]
    seg1 = [None, None, "w1", None, "w3", "w3"]
    assert traj.engine_weight_versions == seg0 + seg1
    assert len(traj.engine_weight_versions) == len(traj.token_ids)
    assert traj.weight_versions.tolist() == [*[0, 0, 1, 1, 0, 1], *[0, 0, 1, 0, 2, 2]]
    assert traj.breaks == [Break("c3", 6, "drift", Drift("c3", "c2", 3, 6, 4))]
    d = traj.to_dict()
    assert d["engine_weight_versions"] == seg0 + seg1
    assert d["breaks"] == [
        {
            "call_id": "c3",
            "position": 6,
            "reason": "drift",
            "detail": d["drift"][0],
        }
    ]


# -- the rules one by one --------------------------------------------------------------------------


async def test_extending_calls_form_one_segment_equal_to_the_last_sequence() -> None:
    c0 = call(0, [1, 2], [3, 4, 5], wv=3)
    c1 = call(1, [1, 2, 3, 4, 5, 6, 7], [8], wv=4)
    c2 = call(2, [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], wv=5)
    traj = build_trajectory(await memory_with(c0, c1, c2), "r")
    assert traj.token_ids == array("i", [*c2.prompt_token_ids, *c2.completion_token_ids])
    assert traj.segments == [Segment(0, 11, ("c0", "c1", "c2"))]
    assert traj.drift == []
    assert traj.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1]
    assert traj.weight_versions.tolist() == [0, 0, 3, 3, 3, 0, 0, 4, 0, 5, 5]
    assert len(traj) == len(traj.logprobs) == len(traj.call_index) == 11
    assert traj.logprobs.typecode == "f"


async def test_prompt_that_stops_short_of_the_sequence_is_drift() -> None:
    # The agent dropped the last answer from its context: the prompt is a strict prefix.
    c0 = call(0, [1, 2, 3], [4, 5])
    c1 = call(1, [1, 2, 3, 4], [6])
    traj = build_trajectory(await memory_with(c0, c1), "r")
    assert traj.drift == [Drift("c1", "c0", 4, 5, 4)]
    assert traj.segments == [Segment(0, 5, ("c0",)), Segment(5, 10, ("c1",))]
    assert traj.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1]


async def test_untooled_calls_apart_by_default_walked_on_request() -> None:
    records = [
        call(0, [1, 2], [3], tools=False),
        call(1, [7, 8], [9]),
        call(2, [7, 8, 9, 5], [6]),
    ]
    sink = await memory_with(*records)
    default = build_trajectory(sink, "r")
    assert (default.calls, default.apart, default.drift) == (["c1", "c2"], ["c0"], [])
    walked = build_trajectory(sink, "r", include_untooled=True)
    assert walked.calls == ["c0", "c1", "c2"]
    assert walked.apart == []
    assert walked.drift == [Drift("c1", "c0", 0, 3, 2)]
    # A rollout with no tooled call at all (plain chat) is not emptied.
    chat = build_trajectory(await memory_with(call(0, [1], [2], tools=False, rollout="q")), "q")
    assert (chat.calls, chat.apart) == (["c0"], [])


async def test_latest_attempt_of_a_retry_wins() -> None:
    c0 = call(0, [1, 2], [3])
    c1 = call(1, [1, 2, 3, 4], [5, 5])  # answered, then the client retried it twice
    c2 = call(2, [1, 2, 3, 4], [6], retry_of="c1")
    c3 = call(3, [1, 2, 3, 4], [7, 7, 7], retry_of="c2")
    c4 = call(4, [1, 2, 3, 4, 7, 7, 7, 8], [9])  # continues from the last attempt
    c5 = call(5, [1, 2, 3, 4, 7, 7, 7, 8, 9, 1], [2], retry_of="gone")  # its first try failed
    traj = build_trajectory(await memory_with(c0, c1, c2, c3, c4, c5), "r")
    assert traj.calls == ["c0", "c3", "c4", "c5"]
    assert traj.retries_skipped == ["c1", "c2"]
    assert traj.drift == []
    assert traj.token_ids.tolist() == [1, 2, 3, 4, 7, 7, 7, 8, 9, 1, 2]


async def test_orphaned_records_are_left_out() -> None:
    c0, c1 = call(0, [1], [2]), call(1, [1, 2, 3], [4])
    sink = await memory_with(c0, c1)
    await sink.mark_orphaned("c1", "stage_timeout")
    traj = build_trajectory(sink, "r")
    assert traj.calls == ["c0"]
    assert traj.token_ids.tolist() == [1, 2]


async def test_unknown_and_empty_rollouts() -> None:
    from capture_proxy.schemas.records import CallStatus, LedgerEntry

    sink = MemorySink()
    with pytest.raises(KeyError, match="nope"):
        build_trajectory(sink, "nope")
    await sink.record_failure(LedgerEntry("bare", "b0", 0, CallStatus.REJECTED, "bad", "x", 422))
    traj = build_trajectory(sink, "bare")
    assert (len(traj), traj.segments, traj.calls) == (0, [], [])


async def test_same_trajectory_from_a_parquet_store(tmp_path: Path) -> None:
    records = [
        call(0, [1, 2, 3], [4], tools=False),
        call(1, [10, 11], [20, 21], wv=1),
        call(2, [10, 11, 20, 21, 5], [22], wv=2),
        call(3, [10, 11, 20, 99], [23], wv=2),
    ]
    sink = ParquetSink(str(tmp_path / "ds"))
    for r in records:
        await sink.stage(r)
    await sink.close()
    from_parquet = Store(ParquetSource(str(tmp_path / "ds"))).trajectory("r", include_open=True)
    from_memory = build_trajectory(await memory_with(*records), "r")
    assert from_parquet.to_dict() == from_memory.to_dict()
    assert from_parquet.drift == [Drift("c3", "c2", 3, 6, 4)]


# -- invariants over random sessions ---------------------------------------------------------------

_turn = st.tuples(
    st.integers(0, 3),  # new prompt tokens
    st.integers(1, 4),  # completion tokens
    st.one_of(st.none(), st.integers(0, 12)),  # drift: keep only this many tokens of history
    st.booleans(),  # tools
    st.integers(0, 3),  # weight version
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_turn, min_size=1, max_size=8))
def test_invariants(turns: list[tuple[int, int, int | None, bool, int]]) -> None:
    records, full, next_id = [], [100], 1000
    for i, (n_new, n_out, cut, tools, wv) in enumerate(turns):
        prompt = full[: cut or None] if cut is not None else list(full)
        prompt += list(range(next_id, next_id + n_new))
        completion = list(range(next_id + n_new, next_id + n_new + n_out))
        next_id += n_new + n_out
        records.append(call(i, prompt or [1], completion, tools=tools, wv=wv))
        full = prompt + completion
    traj = trajectory_from_records("r", records, include_untooled=True)
    n = len(traj.token_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.call_index) == n
    assert len(traj.weight_versions) == n
    # Segments tile the tokens; each is exactly its last call's prompt + completion.
    assert [s.start for s in traj.segments] == [0] + [s.end for s in traj.segments[:-1]]
    assert traj.segments[-1].end == n
    by_id = {r.call_id: r for r in records}
    for seg in traj.segments:
        last = by_id[seg.call_ids[-1]]
        assert traj.token_ids[seg.start : seg.end].tolist() == [
            *last.prompt_token_ids,
            *last.completion_token_ids,
        ]
    assert len(traj.drift) == len(traj.segments) - 1
    # Every generated token is trained on once, with its own logprob and weight version.
    trained = [k for k in range(n) if traj.loss_mask[k]]
    assert [traj.logprobs[k] for k in trained] == [
        lp for r in records for lp in r.completion_logprobs
    ]
    assert [traj.weight_versions[k] for k in trained] == [
        r.weight_version for r in records for _ in r.completion_token_ids
    ]
    assert all(traj.logprobs[k] == 0.0 for k in range(n) if not traj.loss_mask[k])
    assert [traj.calls[traj.call_index[k]] for k in trained] == [
        r.call_id for r in records for _ in r.completion_token_ids
    ]


# -- the driver's outcome ------------------------------------------------------------------------


async def test_the_latest_outcome_gives_the_reward_and_group() -> None:
    sink = await memory_with(call(0, [1, 2], [3]))
    traj = build_trajectory(sink, "r")
    assert (traj.reward, traj.reward_components, traj.group_id) == (None, None, None)
    scalar = RolloutOutcome(reward=0.75, group_id="g-1", at_ms=1)
    info = replace(sink.rollout_info("r"), outcome_history=(scalar,))
    await sink.put_rollout(info)
    traj = build_trajectory(sink, "r")
    assert (traj.reward, traj.reward_components, traj.group_id) == (0.75, None, "g-1")
    # An object of rewards is the components; the scalar reward is then None.
    parts = RolloutOutcome(reward={"correct": 1.0, "style": 0.5}, at_ms=2)
    await sink.put_rollout(replace(info, outcome_history=(scalar, parts)))
    traj = build_trajectory(sink, "r")
    assert (traj.reward, traj.reward_components, traj.group_id) == (
        None,
        {"correct": 1.0, "style": 0.5},
        None,  # the latest outcome named no group: it replaced the earlier one whole
    )
    d = traj.to_dict()
    assert (d["reward"], d["reward_components"], d["group_id"]) == (
        None,
        {"correct": 1.0, "style": 0.5},
        None,
    )
