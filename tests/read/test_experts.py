"""A call's routed experts rebuilt from the deltas its chain of records stores, and every way that
chain can fail to give them."""

from __future__ import annotations

import dataclasses
import sqlite3
from array import array
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capture_proxy.read.experts import ExpertsIncomplete, ExpertsUnavailable, assemble_experts
from capture_proxy.read.integrity import RolloutUnverified
from capture_proxy.read.reader import open_store
from capture_proxy.read.status import RolloutExcluded
from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.experts import NpyArray, encode_npy
from capture_proxy.schemas.records import RolloutInfo, RolloutState, StagedCallRecord
from capture_proxy.sinks.registry import open_sink
from capture_proxy.testing.fake_vllm._experts import encode_experts, experts_for, read_experts

IDS = list(range(50, 80))


def _record(call_id: str, end: int, start: int = 0, **extras: Any) -> StagedCallRecord:
    """A call whose prompt + completion is ``IDS[:end]`` and whose rows start at `start`."""
    values: dict[str, Any] = {"routed_experts": encode_experts(experts_for(IDS[:end], start))}
    if start:
        values["routed_experts_prompt_start"] = start
    values.update(extras)
    return StagedCallRecord(
        rollout_id="r1",
        call_id=call_id,
        seq=int(call_id[1:]),
        model="policy",
        finish_reason="stop",
        request={"messages": []},
        response={"role": "assistant", "content": "x"},
        prompt_token_ids=array("i", IDS[: end - 2]),
        completion_token_ids=array("i", IDS[end - 2 : end]),
        completion_logprobs=array("f", [0.0, 0.0]),
        extras=values,
    )


def _chain() -> dict[str, StagedCallRecord]:
    return {
        "c0": _record("c0", 10),
        "c1": _record("c1", 20, 10, routed_experts_parent_call_id="c0"),
        "c2": _record("c2", 30, 20, routed_experts_parent_call_id="c1"),
    }


def _assemble(records: dict[str, StagedCallRecord], call_id: str, **kw: Any) -> str | None:
    return assemble_experts(records.__getitem__, records[call_id], **kw)


def test_a_chain_of_deltas_gives_every_position() -> None:
    records = _chain()
    for call_id, end in (("c0", 10), ("c1", 20), ("c2", 30)):
        full = _assemble(records, call_id)
        assert full is not None
        assert read_experts(full) == ((end, 2, 2), experts_for(IDS[:end]))


def test_a_start_inside_the_parent_replaces_its_last_rows() -> None:
    # The child asked from 8: positions 8 and 9 are its own rows, not the parent's.
    records = {
        "c0": _record("c0", 10),
        "c1": _record("c1", 20, 8, routed_experts_parent_call_id="c0"),
    }
    full = _assemble(records, "c1")
    assert full is not None
    assert read_experts(full)[1] == experts_for(IDS[:20])


def _without_experts(record: StagedCallRecord) -> StagedCallRecord:
    return dataclasses.replace(record, extras={})


def test_a_record_without_experts_has_none() -> None:
    plain = _without_experts(_record("c0", 10))
    assert _assemble({"c0": plain}, "c0") is None


def test_a_flagged_chain_is_refused_unless_allowed() -> None:
    records = _chain()
    records["c1"] = _record(
        "c1", 20, 10, routed_experts_parent_call_id="c0", routed_experts_incomplete=True
    )
    for call_id in ("c1", "c2"):  # the flag holds for every call built on it
        with pytest.raises(ExpertsIncomplete, match="allow_incomplete"):
            _assemble(records, call_id)
    full = _assemble(records, "c2", allow_incomplete=True)
    assert full is not None
    assert read_experts(full)[0] == (30, 2, 2)


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ({"c1": _record("c1", 20, 10, routed_experts_parent_call_id="c0")}, "not in the store"),
        (
            {
                "c0": _record("c0", 10, routed_experts_parent_call_id="c1"),
                "c1": _record("c1", 20, 10, routed_experts_parent_call_id="c0"),
            },
            "bad experts parent",
        ),
        (
            {
                "c0": _record("c0", 5),
                "c1": _record("c1", 20, 10, routed_experts_parent_call_id="c0"),
            },
            "its parent has 5 rows",
        ),
        (
            {"c1": _record("c1", 20, 10, routed_experts_incomplete=True)},
            "no stored call holds the experts before position 10",
        ),
        (
            {"c1": _record("c1", 20, routed_experts_prompt_start=-1)},
            "bad routed_experts_prompt_start",
        ),
    ],
)
def test_a_chain_that_cannot_be_rebuilt_says_why(
    records: dict[str, StagedCallRecord], message: str
) -> None:
    with pytest.raises(ExpertsUnavailable, match=message):
        _assemble(records, "c1", allow_incomplete=True)


def test_a_parent_without_experts_or_of_another_shape_is_refused() -> None:
    records = _chain()
    records["c0"] = _without_experts(records["c0"])
    with pytest.raises(ExpertsUnavailable, match="holds no routed experts"):
        _assemble(records, "c1")
    # The same values laid out as (10, 4) instead of (10, 2, 2): rows that do not line up.
    data = array("i", experts_for(IDS[:10])).tobytes()
    wide = encode_npy(NpyArray("<i4", (10, 4), data))
    records["c0"] = dataclasses.replace(records["c0"], extras={"routed_experts": wide})
    with pytest.raises(ExpertsUnavailable, match="do not continue"):
        _assemble(records, "c1")


async def test_the_store_reads_verified_records_of_rollouts_it_may_give(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    sink = open_sink(url)
    await sink.put_rollout(RolloutInfo("r1", RolloutState.OPEN, False, 1))
    for record in _chain().values():
        await sink.stage(seal_record(record))
    await sink.close()
    store = open_store(url)
    with pytest.raises(RolloutExcluded, match="include_open"):
        store.routed_experts("c2")
    full = store.routed_experts("c2", include_open=True)
    assert full is not None
    assert read_experts(full)[1] == experts_for(IDS)
    assert store.routed_experts("c2", include_open=True, verify=False) == full
    with pytest.raises(KeyError):
        store.routed_experts("c9", include_open=True)


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_routed_experts_of_a_rollout_that_does_not_verify_are_refused(
    kind: str, tmp_path: Path
) -> None:
    """The routed experts are read through the one meaning of verified: a record whose digest
    holds but that no event of its rollout's log names (put there) makes the whole rollout
    unreadable, its honest calls' experts included, unless ``verify=False``."""
    where = tmp_path / ("store.db" if kind == "sqlite" else "ds")
    url = f"{kind}:///{where}"
    sink = open_sink(url)
    await sink.put_rollout(RolloutInfo("r1", RolloutState.OPEN, False, 1))
    for record in _chain().values():
        await sink.stage(seal_record(record))
    await sink.close()
    if kind == "sqlite":
        with sqlite3.connect(where) as db:
            db.execute("DELETE FROM events WHERE call_id = 'c2'")
        db.close()
    else:
        for f in sorted((where / "ledger").glob("*.parquet")):
            t = pq.read_table(f)
            rows = [r for r in t.to_pylist() if not (r["kind"] == "event" and r["call_id"] == "c2")]
            pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), f)
    with open_store(url) as store:
        for call_id in ("c2", "c0"):
            with pytest.raises(RolloutUnverified, match="no event of the log names"):
                store.routed_experts(call_id, include_open=True)
        full = store.routed_experts("c2", include_open=True, verify=False)
        assert full is not None
        assert read_experts(full)[1] == experts_for(IDS)
