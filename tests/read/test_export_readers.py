"""A segment export read back through pyarrow, DuckDB, Polars and HF `datasets`: the snippet of
docs/trajectories.md, run as written (the trainers' own shapes are held to the trainers' code in
tests/read/trainers/).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from capture_proxy.read.export import export_store
from capture_proxy.read.reader import Store
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import RolloutInfo, RolloutState
from capture_proxy.sinks.sqlite import SQLiteSink, SQLiteSource
from tests.support.sealing import put_sealed
from tests.support.sink_factories import Session, image

DOC = Path(__file__).resolve().parents[2] / "docs" / "trajectories.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


@pytest.fixture
async def export(tmp_path: Path) -> tuple[Path, Path]:
    """A segment export of two rollouts of one group: ``ra`` shows an image, ``rb`` drifts."""
    sink = SQLiteSink(str(tmp_path / "c.db"))
    a, b = Session("ra", image=image("ra")), Session("rb")
    for turn in range(3):
        for s in (a, b):
            r, atts = s.next(drift_at=20 if (s is b and turn == 2) else None)
            await sink.stage(r, attachments=atts)
    judged = {
        "ra": RolloutOutcome({"pass": 1.0, "style": 0.5}, "g"),
        "rb": RolloutOutcome(0.75, "g"),
    }
    for rollout_id, outcome in judged.items():
        await put_sealed(
            sink,
            RolloutInfo(rollout_id, RolloutState.SEALED, False, 1, 2, outcome_history=(outcome,)),
        )
    await sink.close()
    out = tmp_path / "seg.parquet"
    with Store(SQLiteSource(str(tmp_path / "c.db"))) as store:
        done = export_store(store, str(out), per="segment")
    assert done.attachments_out is not None
    return out, Path(done.attachments_out)


def rows(path: Path) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    return got


def test_pyarrow_duckdb_polars_and_datasets_read_it(
    export: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _ = export
    monkeypatch.chdir(out.parent)
    (snippet,) = [b for b in python_blocks() if "import datasets, duckdb, polars" in b]
    namespace: dict[str, Any] = {}
    exec(compile(snippet, f"{DOC.name}:readers", "exec"), namespace)
    want = rows(out)
    frame: pl.DataFrame = namespace["frame"]
    assert frame["response_ids"].to_list() == [r["response_ids"] for r in want]
    assert frame["reward_components"].to_list()[0] == [
        {"name": "pass", "value": 1.0},
        {"name": "style", "value": 0.5},
    ]
    assert namespace["table"].column("response_mask").to_pylist() == [
        r["response_mask"] for r in want
    ]
    ds = namespace["ds"]
    assert ds.num_rows == 3
    assert ds[0]["prompt_ids"] == want[0]["prompt_ids"]
    assert ds[0]["reward_components"] == [
        {"name": "pass", "value": 1.0},
        {"name": "style", "value": 0.5},
    ]
    assert ds[0]["reward"] == 1.5  # the object reward's sum
    got = duckdb.execute(
        "SELECT rollout_id, reward, list_sum([c.value FOR c IN reward_components]), "
        "len(response_ids) FROM read_parquet('seg.parquet')"
    ).fetchall()
    assert got == [
        (
            r["rollout_id"],
            r["reward"],
            1.5 if r["rollout_id"] == "ra" else None,
            len(r["response_ids"]),
        )
        for r in want
    ]
