"""Parquet claim files: created only if absent, by the store itself (a local folder's exclusive
create; object storage's conditional PUT, on moto's S3 server); through a configured pyarrow
filesystem claims are checked, not enforced, and the sink says so when it opens."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from fsspec.implementations.local import LocalFileSystem as FsspecLocal

from capture_proxy.schemas.events import claim_event
from capture_proxy.sinks.base import DuplicateSeq
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource


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
