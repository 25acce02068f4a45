"""The batch API on a local store: each rollout once per consumer, redelivered until acknowledged,
groups only when complete, skips said with their reason. Real SQLite files and Parquet datasets
written through the sinks; a "restart" of the trainer is a store closed and opened again."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from capture_proxy.core.weights import state_header
from capture_proxy.read.batches import BatchUnknown
from capture_proxy.read.reader import open_store
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.cursors import CursorConflict
from capture_proxy.sinks.sqlite import SQLiteSource
from tests.support.batch_store import KINDS, Spec, build, open_sink, put_header, store_path, write
from tests.support.sink_factories import ParquetCase, SQLiteCase


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def ids(n: int, prefix: str = "r") -> list[Spec]:
    return [Spec(f"{prefix}{i}", group=f"g{i // 2}", sealed_at_ms=1_000 + i) for i in range(n)]


async def test_a_batch_comes_again_until_acknowledged_and_never_after_across_restarts(
    kind: str, tmp_path: Path
) -> None:
    url = await build(kind, tmp_path, ids(7))
    with open_store(url) as store:
        first = store.next_batch("trainer-a", rollouts=3, wait_s=0)
        assert first is not None
        assert not first.redelivered
        assert first.rollout_ids == ("r0", "r1", "r2")
        assert [t.rollout_id for t in first.trajectories] == ["r0", "r1", "r2"]
    # The trainer crashed mid-step: its batch, the same one, comes again after the restart.
    with open_store(url) as store:
        again = store.next_batch("trainer-a", rollouts=3, wait_s=0)
        assert again is not None
        assert again.redelivered
        assert (again.batch_id, again.rollout_ids) == (first.batch_id, first.rollout_ids)
        assert again.ack() == 3
        assert again.ack() == 0  # sent twice (an answer lost): harmless
    with open_store(url) as store:
        second = store.next_batch("trainer-a", rollouts=3, wait_s=0)
        assert second is not None
        assert second.rollout_ids == ("r3", "r4", "r5")
        second.ack()
        # One rollout left: not a batch of three; the wait ends with None.
        assert store.next_batch("trainer-a", rollouts=3, wait_s=0.3) is None
        # Another consumer has a place of its own.
        other = store.next_batch("trainer-b", rollouts=7, wait_s=0)
        assert other is not None
        assert len(other.rollout_ids) == 7


async def test_the_iterator_blocks_until_rollouts_arrive_and_hands_each_once(
    kind: str, tmp_path: Path
) -> None:
    path, url = store_path(kind, tmp_path)
    sink = open_sink(kind, path)
    try:
        await write(sink, ids(2))
        got: list[str] = []
        with open_store(url) as store:
            for batch in store.batches("t", rollouts=2, wait_s=0.5):
                got.extend(batch.rollout_ids)
                batch.ack()
                if len(got) == 2:  # the proxy goes on writing while the trainer waits
                    await write(sink, ids(2, prefix="late"))
        assert got == ["r0", "r1", "late0", "late1"]
    finally:
        await sink.close()


async def test_groups_are_delivered_only_when_complete_and_later_members_are_skipped(
    kind: str, tmp_path: Path
) -> None:
    specs = [Spec("a1", group="A"), Spec("b1", group="B"), Spec("a2", group="A")]
    specs += [Spec("b2", group="B", graded=False), Spec("solo")]
    path, url = store_path(kind, tmp_path)
    sink = open_sink(kind, path)
    await write(sink, specs)
    await sink.close()
    with open_store(url) as store:
        batch = store.next_batch("grpo", groups=1, group_size=2, wait_s=0)
        assert batch is not None
        assert batch.plan.groups == {"A": ["a1", "a2"]}
        assert [[t.rollout_id for t in g] for g in batch.groups.values()] == [["a1", "a2"]]
        assert [(s.rollout_id, s.reason) for s in batch.skipped] == [("solo", "no_group")]
        batch.ack()
        # B has one graded member of two: not complete.
        assert store.next_batch("grpo", groups=1, group_size=2, wait_s=0) is None
    sink = open_sink(kind, path)
    await write(sink, [Spec("a3", group="A")])  # A was delivered: a3 comes too late
    await put_header(sink, Spec("b2", group="B"))  # b2 graded now: B is complete
    await sink.close()
    with open_store(url) as store:
        batch = store.next_batch("grpo", groups=1, group_size=2, wait_s=0)
        assert batch is not None
        assert batch.plan.groups == {"B": ["b1", "b2"]}
        skipped = {s.rollout_id: s.reason for s in batch.skipped}
        assert skipped == {"a3": "group_closed"}  # solo was said in the first batch


async def test_poisoned_and_unverified_rollouts_are_skipped_once_with_their_reason(
    kind: str, tmp_path: Path
) -> None:
    case = SQLiteCase(tmp_path) if kind == "sqlite" else ParquetCase(tmp_path)
    specs = [Spec("ok1"), Spec("bad", poisoned=True), Spec("torn"), Spec("ok2")]
    specs += [Spec("m1", group="M"), Spec("m2", group="M", poisoned=True)]
    specs += [Spec("n1", group="N"), Spec("n2", group="N")]
    await write(case.sink, specs)
    await case.sink.close()
    case.tamper("torn-c1", "tokens")
    url = (
        f"sqlite:///{case.path}" if isinstance(case, SQLiteCase) else f"parquet:///{case.location}"
    )
    with open_store(url) as store:
        batch = store.next_batch("t", rollouts=2, wait_s=0)
        assert batch is not None
        assert batch.rollout_ids == ("ok1", "ok2")
        batch.ack()
        assert store.next_batch("t", rollouts=1, wait_s=0) is not None  # m1
        later = store.next_batch("t", rollouts=1, wait_s=0)
        assert later is not None
        assert later.redelivered
        reasons = {s.rollout_id: (s.reason, s.detail) for s in batch.skipped}
        assert reasons["bad"][0] == "poisoned"
        assert "capture_failed" in reasons["bad"][1]
        assert reasons["torn"][0] == "unverified"
        assert "digest mismatch" in reasons["torn"][1]
        grouped = store.next_batch("g", groups=1, group_size=2, wait_s=0)
        assert grouped is not None
        assert grouped.plan.groups == {"N": ["n1", "n2"]}
        by_id = {s.rollout_id: s.reason for s in grouped.skipped}
        # M is complete, but one member is poisoned: the whole group is left out, said once.
        assert by_id == {
            "ok1": "no_group",
            "bad": "no_group",
            "torn": "no_group",
            "ok2": "no_group",
            "m1": "group_excluded",
            "m2": "poisoned",
        }
        grouped.ack()
        assert store.next_batch("g", groups=1, group_size=2, wait_s=0) is None


async def test_rollouts_older_than_max_staleness_are_skipped_and_said(
    kind: str, tmp_path: Path
) -> None:
    path, url = store_path(kind, tmp_path)
    sink = open_sink(kind, path)
    await write(sink, [Spec("v1", weight_version=1), Spec("v2", weight_version=2)])
    await write(sink, [Spec("v3", weight_version=3)])
    await sink.put_rollout(state_header(3))  # the driver's current version
    await sink.close()
    with open_store(url) as store:
        batch = store.next_batch("t", rollouts=2, max_staleness=1, wait_s=0)
        assert batch is not None
        assert batch.rollout_ids == ("v2", "v3")
        assert batch.plan.current_version == 3
        (stale,) = batch.skipped
        assert (stale.rollout_id, stale.reason) == ("v1", "stale")
        assert "weight version 1 is older than 3 - 1" in stale.detail
        # An explicit current version is taken as given.
        other = store.next_batch("u", rollouts=1, max_staleness=0, current_version=1, wait_s=0)
        assert other is not None
        assert other.rollout_ids == ("v1",)


async def test_acknowledging_a_batch_never_handed_is_refused(kind: str, tmp_path: Path) -> None:
    url = await build(kind, tmp_path, ids(2))
    with open_store(url) as store:
        batch = store.next_batch("t", rollouts=1, wait_s=0)
        assert batch is not None
        from capture_proxy.read.batches import _queue

        with pytest.raises(BatchUnknown, match="was not handed batch 't:7'"):
            _queue(store).ack("t", "t:7")
        with pytest.raises(ValueError, match="consumer name 'a b' is not"):
            store.next_batch("a b", rollouts=1, wait_s=0)
        with pytest.raises(ValueError, match="groups=N needs group_size"):
            store.next_batch("t", groups=1, wait_s=0)


async def test_two_processes_saving_one_consumer_at_once_cannot_both_record_a_batch(
    tmp_path: Path,
) -> None:
    url = await build("sqlite", tmp_path, ids(2))
    path = url.removeprefix("sqlite:///")
    one, two = SQLiteSource(path).consumer_cursors(), SQLiteSource(path).consumer_cursors()
    assert one.save("t", b"{}", 0) == 1
    with pytest.raises(CursorConflict, match="at revision 1, not 0"):
        two.save("t", b"{}", 0)
    assert one.load("t") == (b"{}", 1)


async def test_an_older_sqlite_file_lists_the_same_index_and_gets_it_when_migrated(
    tmp_path: Path,
) -> None:
    case = SQLiteCase(tmp_path)
    await write(case.sink, [*ids(4), Spec("open", sealed=False), Spec("p", poisoned=True)])
    await case.sink.close()
    with open_store(f"sqlite:///{case.path}") as store:
        want = store.index()
    with sqlite3.connect(case.path) as db:
        from tests.support.sink_factories import _drop_format_7

        _drop_format_7(db)  # format 6: no index columns, no consumers table
    db.close()
    with open_store(f"sqlite:///{case.path}") as store:
        assert store.index() == want
        assert store.rollouts(group="g1") == ["r2", "r3"]
        with pytest.raises(StoreError, match="older format 6, without consumer cursors"):
            store.next_batch("t", rollouts=1, wait_s=0)
    await open_sink("sqlite", case.path).close()  # a writer migrates it: 6 -> 7, filled
    with open_store(f"sqlite:///{case.path}") as store:
        assert store.index() == want
        assert store.next_batch("t", rollouts=1, wait_s=0) is not None


async def test_the_rollout_index_lists_by_state_group_seal_time_and_grading(
    kind: str, tmp_path: Path
) -> None:
    specs = [*ids(4), Spec("open", sealed=False, group="g9"), Spec("p", poisoned=True)]
    specs.append(Spec("ungraded", graded=False, sealed_at_ms=5_000))
    url = await build(kind, tmp_path, specs)
    with open_store(url) as store:
        assert store.rollouts(state="sealed") == ["r0", "r1", "r2", "r3", "ungraded"]
        assert store.rollouts(state="open") == ["open"]
        assert store.rollouts(state="poisoned") == ["p"]
        assert store.rollouts(group=["g1", "g9"]) == ["r2", "r3", "open"]
        assert store.rollouts(since=1_002) == ["r2", "r3", "ungraded"]
        assert store.rollouts(graded=False) == ["ungraded"]
        assert store.rollouts(state="sealed", graded=True, since=1_003) == ["r3"]
        (row,) = store.index(group="g1", since=1_003)
        assert (row.rollout_id, row.state, row.sealed_at_ms, row.graded) == (
            "r3",
            "sealed",
            1_003,
            True,
        )
        # The filtered export reads the same rollouts.
        assert [t.rollout_id for t in store.iter_trajectories(group="g1")] == ["r2", "r3"]
        assert [t.rollout_id for t in store.iter_trajectories(since=1_003)] == ["r3", "ungraded"]


async def test_a_parquet_readers_index_follows_units_committed_after_it_was_built(
    tmp_path: Path,
) -> None:
    path, url = store_path("parquet", tmp_path)
    sink = open_sink("parquet", path)
    await write(sink, [Spec("a", group="G"), Spec("later", sealed=False, graded=False)])
    with open_store(url) as store:
        assert store.rollouts(group="G") == ["a"]
        assert store.rollouts(state="open") == ["later"]
        # The writer goes on: a new rollout, and an open one sealed and graded.
        await write(sink, [Spec("b", group="G")])
        await put_header(sink, Spec("later", group="G"))
        assert store.rollouts(group="G") == ["a", "later", "b"]
        assert store.rollouts(state="open") == []
    await sink.close()


async def test_a_seal_visible_late_is_found_by_the_next_full_pass(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capture_proxy.read import batch_queue

    path, url = store_path(kind, tmp_path)
    sink = open_sink(kind, path)
    try:
        await write(sink, [Spec(f"r{i}", sealed_at_ms=10_000_000 + i) for i in range(2)])
        with open_store(url) as store:
            batch = store.next_batch("t", rollouts=2, wait_s=0)
            assert batch is not None
            batch.ack()
            # Sealed long before what the consumer has seen (another proxy's late unit, a
            # clock behind): a poll from the horizon does not see it...
            await write(sink, [Spec("late", sealed_at_ms=1_000)])
            assert store.next_batch("t", rollouts=1, wait_s=0) is None
            # ... the next full pass does.
            monkeypatch.setattr(batch_queue, "FULL_PASS_S", 0.0)
            late = store.next_batch("t", rollouts=1, wait_s=0)
            assert late is not None
            assert late.rollout_ids == ("late",)
    finally:
        await sink.close()


async def test_a_parquet_consumers_place_and_index_survive_compaction(tmp_path: Path) -> None:
    from capture_proxy.sinks.parquet import compact_dataset

    path, url = store_path("parquet", tmp_path)
    sink = open_sink("parquet", path)
    await write(sink, ids(3))
    await sink.close()
    with open_store(url) as store:
        batch = store.next_batch("t", rollouts=2, wait_s=0)
        assert batch is not None
        batch.ack()
        pending = store.next_batch("t", rollouts=1, wait_s=0)
        assert pending is not None
    with open_store(url) as watching:
        assert watching.rollouts(group="g0") == ["r0", "r1"]  # its index built
        stats = compact_dataset(str(path), target_bytes=1 << 30, grace_s=0)
        assert stats.units_after < stats.units_before  # units merged and the old files deleted
        assert watching.rollouts(group="g0") == ["r0", "r1"]  # re-indexed, built again
    with open_store(url) as store:
        again = store.next_batch("t", rollouts=1, wait_s=0)
        assert again is not None
        assert (again.batch_id, again.redelivered) == (pending.batch_id, True)
        assert store.rollouts(state="sealed") == ["r0", "r1", "r2"]
