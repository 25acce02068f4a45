"""HF `datasets` opens every export through `load_dataset`, as verl's RLHFDataset does: each
table (per call, trajectory, segment; Parquet and JSON Lines) and the attachments file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capture_proxy.read.export import Per, export_store, read_export_metadata
from tests.support.trainer_rollouts import OUTCOMES, png, stage_rollouts


@pytest.fixture
async def store_url(tmp_path: Path) -> str:
    return await stage_rollouts(tmp_path / "store")


def load(path: Path, cache: Path) -> Any:
    kind = "parquet" if path.suffix == ".parquet" else "json"
    return datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=str(cache))


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
@pytest.mark.parametrize(("per", "rows"), [("call", 8), ("trajectory", 4), ("segment", 6)])
def test_load_dataset_opens_every_export(
    store_url: str, tmp_path: Path, per: Per, rows: int, suffix: str
) -> None:
    out = tmp_path / f"{per}.{suffix}"
    export_store(store_url, str(out), per=per)
    ds = load(out, tmp_path / "hf")
    assert ds.num_rows == rows
    by_rollout = {r["rollout_id"]: r for r in ds}
    # An object reward: its components as {name, value}, and their sum as `reward`.
    assert by_rollout["t1-a"]["reward_components"] == [
        {"name": "pass", "value": 1.0},
        {"name": "style", "value": 0.5},
    ]
    assert by_rollout["t1-a"]["reward"] == 1.5
    assert by_rollout["t1-b"]["reward_components"] is None
    assert {r: row["group_id"] for r, row in by_rollout.items()} == {
        r: o["group_id"] for r, o in OUTCOMES.items()
    }
    if suffix == "parquet":
        assert read_export_metadata(str(out))["export_format_version"] == "2"


def test_load_dataset_opens_the_attachments_file(store_url: str, tmp_path: Path) -> None:
    out = tmp_path / "seg.parquet"
    done = export_store(store_url, str(out), per="segment")
    assert done.attachments_out is not None
    (image,) = load(Path(done.attachments_out), tmp_path / "hf")
    assert (image["media_type"], image["data"]) == ("image/png", png())


def test_a_map_column_is_what_datasets_could_not_load(tmp_path: Path) -> None:
    # Why the column changed (DESIGN §11): the export's former map<string, double> column.
    old = tmp_path / "old.parquet"
    column = pa.array([[("pass", 1.0)]], pa.map_(pa.string(), pa.float64()))
    pq.write_table(pa.table({"reward_components": column}), old)
    with pytest.raises(ValueError, match=r"map<string, double .* datasets dtype"):
        load(old, tmp_path / "hf")
