"""Parquet claim files: created only if absent, by the store itself (a local folder's exclusive
create; object storage's conditional PUT, on moto's S3 server); through a configured pyarrow
filesystem claims are checked, not enforced, and the sink says so when it opens."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import orjson
import pyarrow.fs as pafs
import pytest
from fsspec.implementations.local import LocalFileSystem as FsspecLocal

from capture_proxy.schemas.events import RolloutEvent, claim_event
from capture_proxy.sinks.base import DuplicateSeq, StoreError
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.parquet._claims import SeqClaim, create_claims
from capture_proxy.sinks.parquet._fs import DatasetFS
from capture_proxy.sinks.parquet._layout import create_dataset


async def test_a_claim_is_a_file_created_once(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds))
    try:
        await sink.append_event(claim_event("ep.1:a", 7, "c7", 1))
        claim = ds / "claims" / "ep%2E1%3Aa" / "0000000007"
        assert claim.read_bytes().startswith(b'{"call_id":"c7"')
        with pytest.raises(DuplicateSeq, match=r"rollout ep.1:a already holds seq 7 \(call c7\)"):
            await sink.append_event(claim_event("ep.1:a", 7, "other", 2))
    finally:
        await sink.close()
    # Another writer later (a handoff) is refused by the file system, not by memory.
    again = ParquetSink(str(ds))
    try:
        with pytest.raises(DuplicateSeq, match=r"\(call c7\)"):
            await again.append_event(claim_event("ep.1:a", 7, "late", 3))
    finally:
        await again.close()
    assert ParquetSource(str(ds)).claims("ep.1:a") == {7: "c7"}


async def test_claims_on_another_filesystem_are_checked_and_the_sink_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds = tmp_path / "remote"
    remote = pafs.PyFileSystem(pafs.FSSpecHandler(FsspecLocal()))
    with caplog.at_level(logging.WARNING):
        sink = ParquetSink(str(ds), url=f"parquet:///{ds}", filesystem=remote)
    try:
        assert any(
            "admission claims are checked but not enforced through a pyarrow filesystem"
            in r.getMessage()
            for r in caplog.records
        )
        await sink.append_event(claim_event("ep", 0, "c0", 1))
        with pytest.raises(DuplicateSeq):
            await sink.append_event(claim_event("ep", 0, "other", 2))
    finally:
        await sink.close()


def test_a_batch_of_claims_is_created_together_each_with_its_own_answer(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    dfs = DatasetFS(str(ds))
    create_dataset(dfs)
    (ds / "claims").mkdir(exist_ok=True)
    (ds / "claims" / "blocked").write_bytes(b"a file where the rollout's folder goes")
    held = create_claims(dfs, [SeqClaim("r", 0, "first", 1)], "w0")
    assert held == {("r", 0): "first"}
    batch = [
        SeqClaim("r", 0, "late", 2),  # held already: the holder comes back
        SeqClaim("r", 1, "c1", 3),
        SeqClaim("r2", 0, "d0", 4),
        SeqClaim("r2", 0, "d0-again", 5),  # the same seq twice in a batch: the first asks
        SeqClaim("blocked", 0, "b0", 6),  # its folder cannot be made
    ]
    got = create_claims(dfs, batch, "w1")
    assert {k: v for k, v in got.items() if k != ("blocked", 0)} == {
        ("r", 0): "first",
        ("r", 1): "c1",
        ("r2", 0): "d0",
    }
    assert isinstance(got["blocked", 0], FileExistsError)
    source = ParquetSource(str(ds))
    assert source.claims("r") == {0: "first", 1: "c1"}
    assert source.claims("r2") == {0: "d0"}
    assert orjson.loads((ds / "claims" / "r" / "0000000001").read_bytes())["writer"] == "w1"
    # Nothing of a claim that failed is left behind, and no temporary file of any.
    assert sorted(p.name for p in (ds / "claims").iterdir()) == ["blocked", "r", "r2"]
    assert (ds / "claims" / "blocked").read_bytes().startswith(b"a file")


async def test_a_claim_that_cannot_be_written_fails_its_call_alone(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    sink = ParquetSink(str(ds))
    (ds / "claims").mkdir(exist_ok=True)
    (ds / "claims" / "blocked").write_bytes(b"a file where the rollout's folder goes")
    try:
        results = await asyncio.gather(
            *(sink.append_event(claim_event(f"ok{i}", 0, f"c{i}", 1)) for i in range(6)),
            sink.append_event(claim_event("blocked", 0, "b0", 1)),
            return_exceptions=True,
        )
        *fine, failed = results
        assert all(isinstance(e, RolloutEvent) for e in fine), fine
        assert isinstance(failed, StoreError)
        assert str(failed).startswith("claiming seq 0 of rollout blocked failed (FileExistsError:")
    finally:
        await sink.close()
    source = ParquetSource(str(ds))
    assert [source.claims(f"ok{i}") for i in range(6)] == [{0: f"c{i}"} for i in range(6)]
    assert (ds / "claims" / "blocked").read_bytes().startswith(b"a file")
