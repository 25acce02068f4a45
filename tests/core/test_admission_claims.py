"""Admission claims in the capture core: every admitted call claims its seq in the store, the
claim is awaited before the call's final status, and a rollout continued by another proxy (a
handoff, or a restart) never reuses a seq, even one whose call never ended."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.core.capture import Capture
from capture_proxy.read.reader import Store
from capture_proxy.schemas.events import EventDraft, EventKind, RolloutEvent, claim_event
from capture_proxy.schemas.records import CallStatus
from capture_proxy.sinks.base import StagingSink, StagingSource, StoreError
from capture_proxy.sinks.memory import MemorySink
from capture_proxy.sinks.parquet._claims import SeqClaim, create_claims
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.registry import open_sink, open_source
from tests.support.proxy_harness import chat_body, user


@dataclass
class Answer:
    """What the upstream answered (`CompletionLike`)."""

    prompt_token_ids: array[int] = field(default_factory=lambda: array("i", [1, 2, 3]))
    completion_token_ids: array[int] = field(default_factory=lambda: array("i", [4, 5]))
    completion_logprobs: array[float] = field(default_factory=lambda: array("f", [-0.5, -0.25]))
    finish_reason: str = "stop"
    message: dict[str, Any] = field(default_factory=lambda: {"role": "assistant", "content": "ok"})
    extras: dict[str, Any] = field(default_factory=dict)


def _url(kind: str, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'c.db'}" if kind == "sqlite" else f"parquet:///{tmp_path / 'ds'}"


def _capture(kind: str, tmp_path: Path) -> tuple[Capture, Callable[[], StagingSource]]:
    url = _url(kind, tmp_path)
    sink = open_sink(url)
    return Capture(sink, source=lambda: open_source(url)), lambda: open_source(url)


async def _staged_call(capture: Capture, rollout: str, text: str) -> str:
    await capture.ensure_rollout(rollout)
    call = capture.begin_call(rollout, chat_body(user(text)))
    result = await capture.complete_call(call, Answer(), model="policy")
    assert result.status is CallStatus.STAGED, result
    return call.call_id


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_rollout_handed_to_another_proxy_never_reuses_a_seq(
    kind: str, tmp_path: Path
) -> None:
    first, _ = _capture(kind, tmp_path)
    await _staged_call(first, "ep", "a")
    await _staged_call(first, "ep", "b")
    # A third call is admitted (its seq claimed) and its proxy goes away before it ends.
    left = first.begin_call("ep", chat_body(user("c")))
    assert left.claim is not None
    await left.claim
    await first.sink.close()

    second, reader = _capture(kind, tmp_path)
    try:
        live = await second.ensure_rollout("ep")
        assert live.next_seq == 3  # after the highest claim, not after the last record
        assert live.poisoned
        assert live.outcomes[left.call_id].status == "lost_in_crash"
        taken = await _staged_call(second, "ep", "d")
    finally:
        await second.sink.close()
    source = reader()
    with Store(source) as store:
        assert [s.seq for s in source.summaries("ep")] == [0, 1, 3]
        assert source.claims("ep")[3] == taken
        status = store.status("ep")
        assert status.poisoned
        assert [(n.seq, n.call_id, n.status) for n in status.not_staged] == [
            (2, left.call_id, "lost_in_crash")
        ]
        store.verify()  # a crash is not corruption: every seq is accounted for


@pytest.mark.parametrize("kind", ["memory", "sqlite", "parquet"])
async def test_a_refused_claim_makes_the_call_capture_failed_duplicate_seq(
    kind: str, tmp_path: Path
) -> None:
    """Two proxies that both hold the rollout live (a stale one after a handoff) admit the same
    seq: the store refuses the second claim, and that call is never staged."""
    sink: StagingSink = MemorySink() if kind == "memory" else open_sink(_url(kind, tmp_path))
    a, b = Capture(sink), Capture(sink)
    try:
        await a.ensure_rollout("ep")
        await b.ensure_rollout("ep")
        first = a.begin_call("ep", chat_body(user("x")))
        second = b.begin_call("ep", chat_body(user("y")))
        assert first.seq == second.seq == 0
        assert (await a.complete_call(first, Answer(), model="policy")).status == "staged"
        result = await b.complete_call(second, Answer(), model="policy")
        assert result.status is CallStatus.CAPTURE_FAILED
        assert result.reason == "duplicate_seq"
        assert f"already holds seq 0 (call {first.call_id})" in (result.message or "")
        assert b.rollouts["ep"].poisoned
        # Its ledger entry is refused too (the seq is the other call's), and logged.
        assert b.ledger.refused == 1
    finally:
        await sink.close()


class _ClaimsDown(MemorySink):
    """A store that stages records but cannot write claims."""

    async def append_event(self, event: EventDraft) -> RolloutEvent:
        if event.kind is EventKind.CLAIM:
            raise StoreError("the store is full")
        return await super().append_event(event)


async def test_a_call_whose_claim_cannot_be_written_is_never_staged() -> None:
    sink = _ClaimsDown()
    capture = Capture(sink, stage_timeout=1.0)
    await capture.ensure_rollout("ep")
    call = capture.begin_call("ep", chat_body(user("x")))
    result = await capture.complete_call(call, Answer(), model="policy")
    assert result.status is CallStatus.CAPTURE_FAILED
    assert result.reason == "sink_error"
    assert "claiming seq 0 failed: StoreError: the store is full" in (result.message or "")
    # The record may have landed before the claim's failure was known: then it is orphaned.
    assert sink.calls("ep") == []
    assert [(f.seq, f.reason) for f in sink.failures("ep")] == [(0, "sink_error")]
    assert capture.sink_failing == "StoreError: the store is full"  # /readyz says so


async def test_the_claim_is_written_while_the_call_is_upstream() -> None:
    """Admission does not wait for the claim: it is on its way when `begin_call` returns."""
    sink = MemorySink(delay=0.05)
    capture = Capture(sink)
    await capture.ensure_rollout("ep")
    call = capture.begin_call("ep", chat_body(user("x")))
    assert call.claim is not None
    assert not call.claim.done()
    await capture.fail_call(call, CallStatus.UPSTREAM_ERROR, "upstream_500", "boom", 502)
    await call.claim
    assert sorted(e.kind for e in sink.events("ep")) == ["claim", "ledger"]


class _ClaimsFailLate(MemorySink):
    """Claims fail, slowly: the record is staged before the claim's failure is known."""

    async def append_event(self, event: EventDraft) -> RolloutEvent:
        if event.kind is EventKind.CLAIM:
            await asyncio.sleep(0.2)
            raise StoreError("the claim's batch failed")
        return await super().append_event(event)


async def test_a_record_staged_while_its_claim_failed_is_orphaned_not_staged() -> None:
    sink = _ClaimsFailLate()
    capture = Capture(sink, stage_timeout=2.0)
    await capture.ensure_rollout("ep")
    call = capture.begin_call("ep", chat_body(user("x")))
    result = await capture.complete_call(call, Answer(), model="policy")
    assert (result.status, result.reason) == (CallStatus.CAPTURE_FAILED, "sink_error")
    assert "the claim's batch failed" in (result.message or "")
    assert sink.orphaned() == {call.call_id}
    assert sink.calls("ep") == []  # kept out of trainer reads
    assert [(f.seq, f.reason) for f in sink.failures("ep")] == [(0, "sink_error")]


async def test_a_store_claim_from_elsewhere_moves_the_next_seq() -> None:
    sink = MemorySink()
    await sink.append_event(claim_event("ep", 4, "elsewhere", 0))
    capture = Capture(sink, source=lambda: sink)
    live = await capture.ensure_rollout("ep")
    assert live.next_seq == 5
    assert live.outcomes["elsewhere"].status == "lost_in_crash"


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_proxy_that_comes_back_after_a_handoff_stages_at_the_next_free_seq(
    kind: str, tmp_path: Path
) -> None:
    """Proxy a holds the rollout live; b continues it (a handoff); a's next call takes the seq
    b already claimed: the claim is refused, a reads the rollout again from the store, and the
    call is staged at the next free seq, after b's; a's call after that continues after it."""
    url = _url(kind, tmp_path)
    sink = open_sink(url)
    a = Capture(sink, source=lambda: open_source(url))
    b = Capture(sink, source=lambda: open_source(url))
    try:
        await _staged_call(a, "ep", "a0")
        taken_by_b = await _staged_call(b, "ep", "b1")  # resumed from the store: seq 1
        stale = a.begin_call("ep", chat_body(user("a-stale")))
        assert stale.seq == 1
        result = await a.complete_call(stale, Answer(), model="policy")
        assert result.status is CallStatus.STAGED
        assert stale.seq == 2
        assert a.rollouts["ep"].outcomes[taken_by_b].seq == 1  # a's copy is the store's now
        again = await _staged_call(a, "ep", "a-again")
    finally:
        await sink.close()
    source = open_source(url)
    with Store(source) as store:
        assert [s.seq for s in source.summaries("ep")] == [0, 1, 2, 3]
        assert source.claims("ep")[2] == stale.call_id
        assert source.claims("ep")[3] == again
        store.verify()


async def test_a_rollout_known_only_by_its_claims_continues_after_them(tmp_path: Path) -> None:
    """A proxy killed after its group commit wrote a new rollout's claims and before the unit
    with the rollout's header committed leaves claims only: the rollout exists all the same,
    its next call takes the seq after them, and the claimed call reads ``lost_in_crash``."""
    ds = tmp_path / "ds"
    url = f"parquet:///{ds}"
    first = open_sink(url)  # creates the dataset
    await first.close()
    created = create_claims(DatasetFS(str(ds)), [SeqClaim("ep", 0, "dead", 1)], "killed-proxy")
    assert created == {("ep", 0): "dead"}
    capture, reader = _capture("parquet", tmp_path)
    try:
        again = await _staged_call(capture, "ep", "after the crash")
        assert capture.rollouts["ep"].poisoned
    finally:
        await capture.sink.close()
    source = reader()
    assert source.claims("ep") == {0: "dead", 1: again}
    assert [s.seq for s in source.summaries("ep")] == [1]
