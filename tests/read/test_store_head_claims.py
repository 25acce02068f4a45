"""The store head of a Parquet dataset covers its claim files, as soon as each is durable.

A call's ``claim`` event waits for the next unit (one unit per call): a proxy killed while the
call is in flight leaves the claim file alone, the only trace of the call (it reads
``lost_in_crash`` and poisons the open rollout). Deleting that file would leave a store no
per-rollout check can tell from an honest open rollout; the head its writer published after
the claim catches it. Every honest step (a claim, its event committing with the call's record,
a failed unit, a clean close, a writer opening the store again) leaves the store at the head
published last."""

from __future__ import annotations

import io
import logging
import shutil
from pathlib import Path

import pytest

from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.read.reader import StoreCorrupted, open_store
from capture_proxy.read.status import LOST_IN_CRASH
from capture_proxy.schemas.events import claim_event
from capture_proxy.schemas.records import CallStatus, LedgerEntry
from capture_proxy.schemas.store_head import StoreHead, StoreHeadState
from capture_proxy.sinks.base import StoreError
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.parquet._claim_head import ClaimedHead
from capture_proxy.sinks.parquet._claims import Holders, SeqClaim
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.store_head import StoreHeadKeeper
from tests.read.test_tamper import _call, _seal
from tests.support.sink_factories import Session


def published(sink: ParquetSink) -> StoreHead:
    assert sink.store_head is not None
    return sink.store_head.current()


def recomputed(where: Path) -> StoreHead:
    with open_store(f"parquet:///{where}") as store:
        return store.store_head()


def delete_claim_file(where: Path, call_id: str) -> None:
    (found,) = [
        f
        for f in (where / "claims").rglob("*")
        if f.is_file() and call_id.encode() in f.read_bytes()
    ]
    found.unlink()


async def test_a_deleted_claim_file_of_a_crashed_open_rollout_is_caught_against_the_kept_head(
    tmp_path: Path,
) -> None:
    where = tmp_path / "ds"
    sink = ParquetSink(str(where))
    session = Session("ep")
    first, second = session.next()[0], session.next()[0]
    try:
        await _call(sink, first)
        await sink.append_event(claim_event("ep", second.seq, second.call_id, 2))
        # The store as a SIGKILL now leaves it: the claim file, its event still waiting.
        kept = published(sink)
        url = f"parquet:///{where}"
        with open_store(url) as store:
            assert store.store_head() == kept
            store.verify(expected_store_head=kept.token())
            assert [n.status for n in store.status("ep").not_staged] == [LOST_IN_CRASH]
        delete_claim_file(where, second.call_id)
        with open_store(url) as store:
            # What no per-rollout check sees: the open rollout reads clean.
            assert not store.status("ep").poisoned
            store.verify()
            assert len(store.trajectory("ep", include_open=True).calls) == 1
            with pytest.raises(StoreCorrupted) as caught:
                store.verify(expected_store_head=kept.token())
            (problem,) = caught.value.problems
            assert problem.key == "store"
            assert "1 claim file(s) fewer: a claim file was deleted" in problem.message
            assert store.store_head() != kept
        out = io.StringIO()
        assert (
            inspect_main([url, "--verify", "--expected-store-head", kept.token()], stdout=out) == 1
        )
        assert "not the " + kept.token() in out.getvalue()
    finally:
        await sink.close()


async def test_the_claim_file_of_a_rollout_with_nothing_else_stored_is_covered(
    tmp_path: Path,
) -> None:
    """A rollout's first call killed in flight, with no header stored (a client that names its
    own rollout): the claim file is all there is; the store head counts the rollout."""
    where = tmp_path / "ds"
    sink = ParquetSink(str(where))
    try:
        await sink.append_event(claim_event("fresh", 0, "in-flight", 1))
        kept = published(sink)
        assert (kept.rollouts, kept.events, kept.claims) == (1, 0, 1)
        assert kept.token().endswith(":1:0:1")
        assert recomputed(where) == kept
        delete_claim_file(where, "in-flight")
        with (
            open_store(f"parquet:///{where}") as store,
            pytest.raises(StoreCorrupted, match="1 rollout\\(s\\) the kept head covers are gone"),
        ):
            store.verify(expected_store_head=kept.token())
    finally:
        await sink.close()


async def test_every_honest_step_leaves_the_store_at_the_head_published_last(
    tmp_path: Path,
) -> None:
    where = tmp_path / "ds"
    sink = ParquetSink(str(where))
    session = Session("ep")
    heads = [published(sink)]
    try:
        for _ in range(2):
            record = session.next()[0]
            await sink.append_event(claim_event("ep", record.seq, record.call_id, 1))
            heads.append(published(sink))  # the claim file: the head moved with it
            assert recomputed(where) == heads[-1]
            assert (await sink.stage(record)).status is CallStatus.STAGED
            heads.append(published(sink))  # its event and the record, in one unit
            assert recomputed(where) == heads[-1]
        await sink.append_event(claim_event("ep", 2, "refused", 1))
        await sink.record_failure(
            LedgerEntry("ep", "refused", 2, CallStatus.REJECTED, "bad_request", "no", 400, 2)
        )
        heads.append(published(sink))
        assert recomputed(where) == heads[-1]
        await sink.append_event(claim_event("ep", 3, "in-flight", 3))
        heads.append(published(sink))
        assert recomputed(where) == heads[-1]
        await _seal(sink, "ep", False, 0.5)
        heads.append(published(sink))
        assert recomputed(where) == heads[-1]
    finally:
        await sink.close()
    assert len(set(heads)) == len(heads)  # every step moved it
    # A clean close commits nothing new here (the seal's unit took the waiting claim event).
    assert recomputed(where) == published(sink) == heads[-1]
    assert (heads[-1].rollouts, heads[-1].events, heads[-1].claims) == (1, 9, 4)
    reopened = ParquetSink(str(where))
    try:
        assert published(reopened) == heads[-1]
    finally:
        await reopened.close()


async def test_a_claim_whose_event_waits_until_close_matches_before_and_after(
    tmp_path: Path,
) -> None:
    where = tmp_path / "ds"
    sink = ParquetSink(str(where))
    session = Session("ep")
    first, lost, after = (session.next()[0] for _ in range(3))
    await _call(sink, first)
    await sink.append_event(claim_event("ep", lost.seq, lost.call_id, 2))
    crashed = tmp_path / "crashed"
    shutil.copytree(where, crashed)  # the dataset as a SIGKILL here would leave it
    kept = published(sink)
    await sink.close()  # the waiting claim event commits as a last unit
    assert recomputed(where) == published(sink)
    # The dataset a crash left: what it holds is the head published before it, and a writer
    # opening it starts there.
    assert recomputed(crashed) == kept
    (crashed / "_writer.lock").unlink(missing_ok=True)
    restarted = ParquetSink(str(crashed))
    try:
        assert published(restarted) == kept
        await _call(restarted, after)  # the seq after the lost one
        assert recomputed(crashed) == published(restarted)
        with open_store(f"parquet:///{crashed}") as store:
            assert [n.call_id for n in store.status("ep").not_staged] == [lost.call_id]
    finally:
        await restarted.close()


async def test_a_failed_unit_leaves_the_store_at_the_head_published_last(tmp_path: Path) -> None:
    """A unit that fails takes the waiting claim events with it; the claim files stand, as
    after a crash, and so does the head that covers them."""
    where = tmp_path / "ds"
    sink = ParquetSink(str(where))
    try:
        await _call(sink, Session("ok").next()[0])
        claimed = Session("ep").next()[0]
        await sink.append_event(claim_event("ep", 0, claimed.call_id, 1))
        (where / "ledger").rename(where / "ledger.aside")
        (where / "ledger").write_bytes(b"")
        with pytest.raises(StoreError, match="nothing of this batch was stored"):
            await sink.stage(Session("nope").next()[0])  # its claim file stands too
        (where / "ledger").unlink()
        (where / "ledger.aside").rename(where / "ledger")
        kept = published(sink)
        assert recomputed(where) == kept
        assert (await sink.stage(claimed)).status is CallStatus.STAGED
        assert recomputed(where) == published(sink)
    finally:
        await sink.close()
    assert recomputed(where) == published(sink)


def test_a_claim_the_head_cannot_take_in_stands_and_the_writer_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The head's bookkeeping never fails a claim: when it cannot read what it needs (here the
    last committed event of a rollout, which a writer reads back from the store for a sealed
    one), the claim stands and the writer logs that its head will not match until it reopens."""

    def unreadable(rollout_id: str) -> tuple[int, str] | None:
        raise StoreError(f"reading {rollout_id}'s events failed")

    where = tmp_path / "ds"
    dfs = DatasetFS(str(where))
    dfs.makedirs("claims")
    keeper = StoreHeadKeeper(str(where), StoreHeadState())
    before = keeper.current()
    holders = Holders(dfs, "w", ClaimedHead(dfs, keeper, unreadable).created)
    claim = SeqClaim("ep", 0, "c0", 1)
    with caplog.at_level(logging.ERROR):
        holders.settle([claim])
    assert holders.holder(claim) == "c0"  # the claim is the store's
    assert "the store head could not take in 1 new claim file(s)" in caplog.text
    assert keeper.current() == before
