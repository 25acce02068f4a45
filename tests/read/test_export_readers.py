"""A segment export read back the way trainers read it: the verl, SkyRL and NeMo RL loaders of
docs/trajectories.md (run from the page, so the page cannot drift from the export), and the same
file through pyarrow, DuckDB, Polars and HF `datasets` (the page's snippet, run as written).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
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


def loader(name: str) -> Any:
    (code,) = [b for b in python_blocks() if b.startswith(f"# loader: {name}\n")]
    namespace: dict[str, Any] = {}
    exec(compile(code, f"{DOC.name}:{name}", "exec"), namespace)
    return namespace["load"]


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


def test_verl_loader(export: tuple[Path, Path]) -> None:
    out, images = export
    samples = list(loader("verl")(str(out), str(images)))
    assert len(samples) == 3  # ra: 1 segment; rb: 2 (it drifted)
    for sample, row in zip(samples, rows(out), strict=True):
        assert set(sample) == {
            "prompt_ids",
            "response_ids",
            "response_mask",
            "response_logprobs",
            "reward_score",
            "num_turns",
            "routed_experts",
            "multi_modal_data",
        }
        assert len(sample["response_ids"]) == len(sample["response_mask"])
        assert len(sample["response_logprobs"]) == len(sample["response_ids"])
        assert sample["response_mask"][0] == 1
        assert sample["num_turns"] == 3
        assert sample["reward_score"] == (None if row["rollout_id"] == "ra" else 0.75)
    (ra,) = [s for s, r in zip(samples, rows(out), strict=True) if r["rollout_id"] == "ra"]
    assert ra["multi_modal_data"]["image"] == [image("ra").data]


def test_skyrl_loader(export: tuple[Path, Path]) -> None:
    out, images = export
    batch = loader("skyrl")(str(out), str(images))
    assert set(batch) == {
        "prompt_token_ids",
        "response_ids",
        "loss_masks",
        "rollout_logprobs",
        "rewards",
        "stop_reasons",
        "trajectory_ids",
    }
    assert {len(v) for v in batch.values()} == {3}
    assert batch["trajectory_ids"] == ["ra", "rb", "rb"]  # one group, adjacent
    assert batch["stop_reasons"] == ["stop"] * 3
    assert all(
        len(ids) == len(mask)
        for ids, mask in zip(batch["response_ids"], batch["loss_masks"], strict=True)
    )


def test_nemo_rl_loader(export: tuple[Path, Path]) -> None:
    out, images = export
    samples: Iterable[dict[str, Any]] = loader("nemo-rl")(str(out), str(images))
    for sample, row in zip(samples, rows(out), strict=True):
        log = sample["message_log"]
        assert log[0] == {"role": "user", "token_ids": row["prompt_ids"]}
        # The messages re-assemble the response; assistant messages carry their logprobs.
        assert [t for m in log[1:] for t in m["token_ids"]] == row["response_ids"]
        roles = [m["role"] for m in log[1:]]
        assert roles[0] == "assistant"
        assert set(roles) <= {"assistant", "tool"}
        assert all(
            len(m["generation_logprobs"]) == len(m["token_ids"])
            for m in log[1:]
            if m["role"] == "assistant"
        )
        assert (sample["idx"], sample["total_reward"]) == (row["rollout_id"], row["reward"])


def test_pyarrow_duckdb_polars_and_datasets_read_it(
    export: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _ = export
    monkeypatch.chdir(out.parent)
    (snippet,) = [b for b in python_blocks() if "import duckdb, polars" in b]
    namespace: dict[str, Any] = {}
    exec(compile(snippet, f"{DOC.name}:readers", "exec"), namespace)
    want = rows(out)
    frame: pl.DataFrame = namespace["frame"]
    assert frame["response_ids"].to_list() == [r["response_ids"] for r in want]
    assert frame["reward_components"].to_list()[0] == {"pass": 1.0, "style": 0.5}
    assert namespace["table"].column("response_mask").to_pylist() == [
        r["response_mask"] for r in want
    ]
    ds = namespace["ds"]
    assert ds.num_rows == 3
    assert ds[0]["prompt_ids"] == want[0]["prompt_ids"]
    assert ds[0]["reward_components"] == [
        {"key": "pass", "value": 1.0},
        {"key": "style", "value": 0.5},
    ]
    got = duckdb.execute(
        "SELECT rollout_id, reward, reward_components['style'], len(response_ids) "
        "FROM read_parquet('seg.parquet')"
    ).fetchall()
    assert got == [
        (
            r["rollout_id"],
            r["reward"],
            0.5 if r["rollout_id"] == "ra" else None,
            len(r["response_ids"]),
        )
        for r in want
    ]
