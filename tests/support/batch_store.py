"""Stores for the batch API's tests: rollouts written through the real sinks, sealed, graded
(an outcome with a reward and a group), poisoned or stamped with a weight version on request."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.outcome import RolloutOutcome
from capture_proxy.schemas.records import CallStatus, LedgerEntry, RolloutInfo, RolloutState
from capture_proxy.sinks.base import StagingSink
from capture_proxy.sinks.parquet import ParquetSink
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.support.sealing import put_header as put_header_as_proxy
from tests.support.sink_factories import Session

KINDS = ("sqlite", "parquet")


@dataclass(frozen=True)
class Spec:
    """One rollout to write: two staged calls, then its header."""

    rollout_id: str
    group: str | None = None
    graded: bool = True
    sealed: bool = True
    poisoned: bool = False
    weight_version: int = 0
    sealed_at_ms: int = 1_000


def store_path(kind: str, tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / ("store.db" if kind == "sqlite" else "ds")
    return path, f"{kind}:///{path}"


def open_sink(kind: str, path: Path) -> StagingSink:
    return SQLiteSink(str(path)) if kind == "sqlite" else ParquetSink(str(path))


async def write(sink: StagingSink, specs: list[Spec], *, calls: int = 2) -> None:
    """Write each rollout of `specs` through `sink` (which stays open)."""
    for spec in specs:
        session = Session(spec.rollout_id)
        for _ in range(calls):
            record, _ = session.next()
            if spec.weight_version:
                record = seal_record(
                    dataclasses.replace(record, weight_version=spec.weight_version)
                )
            await sink.stage(record)
        if spec.poisoned:
            await sink.record_failure(
                LedgerEntry(
                    spec.rollout_id,
                    f"{spec.rollout_id}-lost",
                    calls,
                    CallStatus.CAPTURE_FAILED,
                    "sink_error",
                    "the test's capture failure",
                    None,
                    spec.sealed_at_ms,
                )
            )
        await put_header(sink, spec)


async def put_header(sink: StagingSink, spec: Spec) -> None:
    outcomes = (
        (RolloutOutcome(reward=1.0, group_id=spec.group, at_ms=spec.sealed_at_ms),)
        if spec.graded
        else ()
    )
    # As the proxy writes them (the header, then its seal and outcome events): verified reads
    # hold the header to the event log.
    await put_header_as_proxy(
        sink,
        RolloutInfo(
            spec.rollout_id,
            RolloutState.SEALED if spec.sealed else RolloutState.OPEN,
            False,
            1,
            spec.sealed_at_ms if spec.sealed else None,
            {},
            {},
            outcomes,
        ),
    )


async def build(kind: str, tmp_path: Path, specs: list[Spec]) -> str:
    """A closed store holding `specs`; its URL."""
    path, url = store_path(kind, tmp_path)
    sink = open_sink(kind, path)
    try:
        await write(sink, specs)
    finally:
        await sink.close()
    return url
