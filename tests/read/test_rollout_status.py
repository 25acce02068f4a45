"""What trainers read is true about the rollout: open or sealed, poisoned or not, the calls that
were not staged, a `not_staged` break where a lost answer sits in a later prompt, and verification
on read. Every test runs on both stores (SQLite file, Parquet dataset).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from capture_proxy.read.integrity import RolloutUnverified
from capture_proxy.read.reader import Store
from capture_proxy.read.status import NotStaged, RolloutExcluded
from capture_proxy.read.trajectory import Break
from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.records import (
    CallStatus,
    LedgerEntry,
    RolloutInfo,
    RolloutState,
    StagedCallRecord,
)
from capture_proxy.sinks.base import StagingSink
from tests.support.sealing import put_sealed
from tests.support.sink_factories import SINKS, Session, SinkCase

KINDS = ["sqlite", "parquet"]


async def lost_middle_call(
    sink: StagingSink, rollout_id: str = "p", *, status: CallStatus = CallStatus.CAPTURE_FAILED
) -> tuple[StagedCallRecord, StagedCallRecord, StagedCallRecord]:
    """Three calls; the middle one answered the client (its answer is in the third call's
    prompt) but was not staged: it is in the ledger with `status`. The third call's parent is
    the first (the parent chain skips the lost call, as the proxy's parent search does)."""
    s = Session(rollout_id)
    first, _ = s.next()
    lost, _ = s.next()
    s.parent = first.call_id
    third, _ = s.next()
    assert (await sink.stage(first)).status is CallStatus.STAGED
    await sink.record_failure(
        LedgerEntry(rollout_id, lost.call_id, lost.seq, status, "missing_token_ids", "no ids")
    )
    assert (await sink.stage(third)).status is CallStatus.STAGED
    return first, lost, third


async def seal(sink: StagingSink, *rollout_ids: str) -> None:
    """Seal as the proxy does: the header, then the seal event."""
    for rollout_id in rollout_ids:
        await put_sealed(sink, RolloutInfo(rollout_id, RolloutState.SEALED, False, 1, 2))


async def closed(case: SinkCase) -> Store:
    await case.sink.close()
    return Store(case.reopen())


@pytest.mark.parametrize("kind", KINDS)
async def test_capture_failed_call_poisons_and_its_answer_is_never_prompt(
    kind: str, tmp_path: Path
) -> None:
    case = SINKS[kind](tmp_path)
    first, lost, third = await lost_middle_call(case.sink)
    await seal(case.sink, "p")
    with await closed(case) as store:
        with pytest.raises(RolloutExcluded, match="include_poisoned=True") as caught:
            store.trajectory("p")
        assert lost.call_id in str(caught.value)
        with pytest.raises(RolloutExcluded, match="include_poisoned=True"):
            store.calls("p")
        assert list(store.iter_trajectories()) == []
        traj = store.trajectory("p", include_poisoned=True)
    gone = NotStaged(lost.seq, lost.call_id, "capture_failed", "missing_token_ids")
    assert (traj.state, traj.poisoned, traj.n_failures) == (RolloutState.SEALED, True, 1)
    assert traj.not_staged == [gone]
    # The lost answer is in the third prompt: it opens a new segment instead of being appended
    # to the first call's sequence as prompt tokens.
    boundary = len(first.prompt_token_ids) + len(first.completion_token_ids)
    assert traj.breaks == [Break(third.call_id, boundary, "not_staged", gone)]
    assert traj.drift == []
    assert [s.call_ids for s in traj.segments] == [(first.call_id,), (third.call_id,)]
    assert traj.token_ids[boundary:].tolist() == [
        *third.prompt_token_ids,
        *third.completion_token_ids,
    ]
    assert traj.to_dict()["breaks"][0]["detail"] == {
        "seq": lost.seq,
        "call_id": lost.call_id,
        "status": "capture_failed",
        "reason": "missing_token_ids",
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", [CallStatus.UPSTREAM_ERROR, CallStatus.ABORTED])
async def test_a_stream_ended_early_does_not_poison_and_its_tokens_are_never_prompt(
    kind: str, status: CallStatus, tmp_path: Path
) -> None:
    """An upstream error or an abort does not poison, but its stream may have delivered tokens
    the client replays in the next prompt: the next call opens a segment of its own."""
    case = SINKS[kind](tmp_path)
    first, _, third = await lost_middle_call(case.sink, status=status)
    await seal(case.sink, "p")
    with await closed(case) as store:
        traj = store.trajectory("p")
    assert (traj.poisoned, traj.n_failures) == (False, 1)
    assert traj.not_staged[0].status == status.value
    assert traj.calls == [first.call_id, third.call_id]
    (brk,) = traj.breaks
    assert (brk.call_id, brk.reason, brk.detail) == (
        third.call_id,
        "not_staged",
        traj.not_staged[0],
    )
    start = brk.position
    assert list(traj.loss_mask[start : start + len(third.prompt_token_ids)]) == [0] * len(
        third.prompt_token_ids
    )
    assert sum(traj.loss_mask) == len(first.completion_token_ids) + len(third.completion_token_ids)


@pytest.mark.parametrize("kind", KINDS)
async def test_the_retry_of_a_failed_call_continues_its_segment(kind: str, tmp_path: Path) -> None:
    """A call that repeats the failed call's request (`retry_of`) holds none of its answer."""
    case = SINKS[kind](tmp_path)
    s = Session("p")
    first, failed = s.next()[0], s.next()[0]
    retry = seal_record(replace(failed, call_id="p-retry", seq=2, retry_of=failed.call_id))
    assert (await case.sink.stage(first)).status is CallStatus.STAGED
    await case.sink.record_failure(
        LedgerEntry("p", failed.call_id, 1, CallStatus.UPSTREAM_ERROR, "upstream_500", "", 500)
    )
    assert (await case.sink.stage(retry)).status is CallStatus.STAGED
    await seal(case.sink, "p")
    with await closed(case) as store:
        traj = store.trajectory("p")
    assert (traj.breaks, traj.calls) == ([], [first.call_id, "p-retry"])


@pytest.mark.parametrize("kind", KINDS)
async def test_orphaned_record_poisons_its_rollout(kind: str, tmp_path: Path) -> None:
    case = SINKS[kind](tmp_path)
    s = Session("o")
    keep, late = s.next()[0], s.next()[0]
    for r in (keep, late):
        await case.sink.stage(r)
    await case.sink.mark_orphaned(late.call_id, "stage_timeout")
    await seal(case.sink, "o")
    with await closed(case) as store:
        traj = store.trajectory("o", include_poisoned=True)
        assert [r.call_id for r in store.calls("o", include_poisoned=True)] == [keep.call_id]
    assert traj.poisoned
    assert traj.not_staged == [NotStaged(late.seq, late.call_id, "orphaned", "orphaned")]


@pytest.mark.parametrize("kind", KINDS)
async def test_open_rollouts_are_left_out_until_sealed(kind: str, tmp_path: Path) -> None:
    case = SINKS[kind](tmp_path)
    done, running = Session("done"), Session("running")
    for s in (done, running):
        for _ in range(2):
            await case.sink.stage(s.next()[0])
    await lost_middle_call(case.sink, "bad")
    await seal(case.sink, "done")
    with await closed(case) as store:
        skipped: dict[str, list[str]] = {}
        assert [t.rollout_id for t in store.iter_trajectories(skipped=skipped)] == ["done"]
        assert skipped == {"open": ["running"], "poisoned": ["bad"]}
        every = store.iter_trajectories(include_open=True, include_poisoned=True)
        assert [(t.rollout_id, t.state, t.poisoned) for t in every] == [
            ("done", RolloutState.SEALED, False),
            ("running", RolloutState.OPEN, False),
            ("bad", RolloutState.OPEN, True),
        ]
        with pytest.raises(RolloutExcluded, match="include_open=True") as caught:
            store.calls("running")
        assert caught.value.keyword == "include_open"
        assert len(store.calls("running", include_open=True)) == 2
        with pytest.raises(KeyError):
            store.trajectory("nope")


@pytest.mark.parametrize("kind", KINDS)
async def test_reads_verify_digests_unless_told_not_to(kind: str, tmp_path: Path) -> None:
    case = SINKS[kind](tmp_path)
    s = Session("t")
    records = [s.next()[0] for _ in range(3)]
    for r in records:
        await case.sink.stage(r)
    await seal(case.sink, "t")
    await case.sink.close()
    case.tamper(records[1].call_id, "tokens")
    with Store(case.reopen()) as store:
        with pytest.raises(RolloutUnverified, match=records[1].call_id) as e:
            store.calls("t")
        assert e.value.keyword == "verify"
        with pytest.raises(RolloutUnverified, match=records[1].call_id):
            store.trajectory("t")
        skipped: dict[str, list[str]] = {}
        why: dict[str, list[str]] = {}
        assert list(store.iter_trajectories(skipped=skipped, unverified=why)) == []
        assert skipped["unverified"] == ["t"]
        assert why["t"][0].startswith(f"{records[1].call_id}: digest mismatch")
        # Opting out reads the stored (damaged) data as it is.
        assert len(store.calls("t", verify=False)) == 3
        assert store.trajectory("t", verify=False).calls == [r.call_id for r in records]
        assert len(list(store.iter_trajectories(verify=False))) == 1
