"""A rollout's header read back as the newest written even when a compaction put it out of unit
order: with several writers, a merged unit takes its last unit's order, so a writer's unit that
committed after the compaction listed the units (named before another writer's last unit) sorts
before the merged unit holding the rollout's older header. Each header carries a revision (its
rollout's chain head when written), and readers keep the newest; headers written before
revisions replay in unit order, as they always did."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.events import EventDraft, EventKind
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._gc import load_markers, replace_units
from capture_proxy.sinks.parquet._layout import LEDGER, Marker, live_units, new_unit_name
from capture_proxy.sinks.parquet._ledger import LedgerState, rollout_row
from tests.support.sink_factories import Session

OPEN = RolloutInfo("r", RolloutState.OPEN, False, 1_000)


def _merge_first_after_last(ds: str) -> None:
    """Merge the dataset's first unit with another writer's empty unit named after its last one,
    as a compaction that listed the units while the later ones were still committing: the
    merged unit (holding the first header) then sorts after every other unit."""
    dfs = DatasetFS(ds)
    units = live_units(load_markers(dfs))
    first, last = units[0], units[-1]
    other = Marker(unit=new_unit_name(last.order)[0], files={}, rows={})
    dfs.put_all({other.rel: other.encode()})
    merged = replace_units(dfs, [first, other], load_markers(dfs), lambda _t, table: table)
    assert merged.order > last.order


def _inspected(ds: str) -> Any:
    out = io.StringIO()
    assert inspect_main([f"parquet:///{ds}", "--rollout", "r", "--json"], stdout=out) == 0
    return orjson.loads(out.getvalue())["rollout"]


async def _open_with_a_call(ds: str) -> ParquetSink:
    sink = ParquetSink(ds)
    await sink.put_rollout(OPEN)  # its own unit: the first, which the compaction merges
    await sink.stage(Session("r").next()[0])
    return sink


async def test_a_seal_committed_before_the_merged_open_header_reads_sealed(
    tmp_path: Path,
) -> None:
    ds = str(tmp_path / "ds")
    sink = await _open_with_a_call(ds)
    await sink.put_rollout(replace(OPEN, state=RolloutState.SEALED, sealed_at_ms=2_000))
    await sink.append_event(EventDraft("r", EventKind.SEAL, 2_000))
    await sink.close()
    _merge_first_after_last(ds)

    with open_store(f"parquet:///{ds}") as store:
        assert store.status("r").state is RolloutState.SEALED
        info = store.rollout_info("r")
        assert (info.state, info.sealed_at_ms) == (RolloutState.SEALED, 2_000)
        assert [t.rollout_id for t in store.iter_trajectories()] == ["r"]  # sealed ones only
        store.verify()
    assert _inspected(ds)["state"] == "sealed"
    # A proxy's reader (a units index: the ledger replayed per rollout) reads it so too.
    assert ParquetSource(ds, index="units").rollout_info("r").state is RolloutState.SEALED


async def test_an_outcome_committed_before_the_merged_older_one_reads_current(
    tmp_path: Path,
) -> None:
    ds = str(tmp_path / "ds")
    sink = await _open_with_a_call(ds)
    first = (RolloutOutcome(reward=0.0, at_ms=1_500),)
    second = (*first, RolloutOutcome(reward=1.0, at_ms=1_600))
    for n, history in enumerate((first, second), 1):
        await sink.put_rollout(replace(OPEN, outcome_history=history))
        body = {"reward": history[-1].reward, "group_id": None, "revision": n}
        await sink.append_event(EventDraft("r", EventKind.OUTCOME, 1_500, body=body))
    await sink.close()
    # The merged first unit holds the header before any outcome; move the first outcome's
    # header after the second's too: merge the first two units with one named after the last.
    dfs = DatasetFS(ds)
    units = live_units(load_markers(dfs))
    ledgers = [u for u in units if LEDGER in u.files]
    with_first = next(u for u in ledgers if _headers(dfs, u) == [1])
    other = Marker(unit=new_unit_name(units[-1].order)[0], files={}, rows={})
    dfs.put_all({other.rel: other.encode()})
    merged = replace_units(dfs, [with_first, other], load_markers(dfs), lambda _t, t: t)
    assert merged.order > units[-1].order

    with open_store(f"parquet:///{ds}") as store:
        assert store.status("r").outcome == second[-1]
        assert store.rollout_info("r").outcome_history == second
    doc = _inspected(ds)
    assert (doc["outcomes"], doc["outcome"]["reward"]) == (2, 1.0)
    assert ParquetSource(ds, index="units").rollout_info("r").outcome_history == second


def _headers(dfs: DatasetFS, unit: Marker) -> list[int]:
    """The outcome counts of the headers in `unit`'s ledger file."""
    with dfs.open(unit.files[LEDGER]) as f:
        rows = pq.read_table(f).to_pylist()
    state = LedgerState()
    state.apply(r for r in rows if r["kind"] == "rollout")
    return [len(i.outcome_history) for i in state.rollouts.values()]


def _state(ledger: LedgerState) -> RolloutState:
    return ledger.rollouts["r"].state


def test_headers_without_a_revision_replay_in_unit_order() -> None:
    """A dataset written before revisions reads as it always did: the last header wins."""
    sealed = replace(OPEN, state=RolloutState.SEALED, sealed_at_ms=2_000)
    state = LedgerState()
    state.apply([rollout_row(sealed), rollout_row(OPEN)])
    assert _state(state) is RolloutState.OPEN
    # A header with a revision after one without: replaces it (the revision dates it against
    # later headers only).
    state.apply([rollout_row(sealed, 3), rollout_row(OPEN, 1)])
    assert _state(state) is RolloutState.SEALED
    # Files written before event logs have no position column at all.
    old = {k: v for k, v in rollout_row(OPEN).items() if k != "position"}
    state.apply([old])
    assert _state(state) is RolloutState.OPEN


def test_one_revision_orders_by_seal_then_outcomes_then_unit_order() -> None:
    sealed = replace(OPEN, state=RolloutState.SEALED, sealed_at_ms=2_000)
    history = (RolloutOutcome(reward=1.0, at_ms=1_500),)
    state = LedgerState()
    state.apply([rollout_row(sealed, 4), rollout_row(OPEN, 4)])
    assert _state(state) is RolloutState.SEALED
    state.apply([rollout_row(replace(OPEN, outcome_history=history), 4)])
    assert _state(state) is RolloutState.SEALED  # sealed outranks more outcomes
    state.apply([rollout_row(replace(sealed, outcome_history=history), 4)])
    assert state.rollouts["r"].outcome_history == history
    renamed = replace(sealed, outcome_history=history, metadata={"k": "v"})
    state.apply([rollout_row(renamed, 4)])
    assert state.rollouts["r"].metadata == {"k": "v"}  # a tie: the later in unit order


async def test_a_header_carries_its_rollouts_chain_head_as_revision(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    sink = await _open_with_a_call(ds)
    await sink.put_rollout(replace(OPEN, state=RolloutState.SEALED, sealed_at_ms=2_000))
    await sink.append_event(EventDraft("r", EventKind.SEAL, 2_000))
    # Outcome after the seal: the writer dropped the chain's head and reads it back.
    history = (RolloutOutcome(reward=1.0, at_ms=2_500),)
    await sink.put_rollout(
        replace(OPEN, state=RolloutState.SEALED, sealed_at_ms=2_000, outcome_history=history)
    )
    await sink.close()
    dfs = DatasetFS(ds)
    tables = []
    for u in live_units(load_markers(dfs)):
        if LEDGER in u.files:
            with dfs.open(u.files[LEDGER]) as f:
                tables.append(pq.read_table(f))
    ledger = pa.concat_tables(tables, promote_options="default")
    headers = ledger.filter(pc.equal(ledger["kind"], "rollout"))
    # Before any event; after the staged call's event (0); after the seal event (1).
    assert headers.column("position").to_pylist() == [-1, 0, 1]
