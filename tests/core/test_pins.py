"""A rollout's replica pin: set at once in memory, written as a ``replica`` event, read back."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from capture_proxy.core.pins import pin, write_pin
from capture_proxy.core.rollouts import RolloutLive, pinned_replica
from capture_proxy.schemas.events import EventKind
from capture_proxy.sinks.registry import open_source
from capture_proxy.sinks.sqlite import SQLiteSink

A, B = "http://vllm-0:8000", "http://vllm-1:8000"


async def test_a_pin_and_a_move_are_events_read_back_as_the_latest(tmp_path: Path) -> None:
    sink = SQLiteSink(str(tmp_path / "store.db"))
    try:
        live = RolloutLive("r1")
        await write_pin(sink, pin(live, A))
        assert live.replica == A
        await write_pin(sink, pin(live, B))
    finally:
        await sink.close()
    source = open_source(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        events = source.events("r1")
    finally:
        source.close_reader()
    assert [(e.kind, e.body) for e in events] == [
        (EventKind.REPLICA, {"replica": A}),
        (EventKind.REPLICA, {"replica": B, "moved_from": A}),
    ]
    assert pinned_replica(events) == B
    assert pinned_replica([]) == ""


async def test_a_pin_the_store_cannot_write_is_kept_in_memory_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = SQLiteSink(str(tmp_path / "store.db"))
    await sink.close()  # every write now fails
    live = RolloutLive("r1")
    with caplog.at_level(logging.WARNING, logger="capture_proxy.replicas"):
        assert await write_pin(sink, pin(live, A)) is None
    assert live.replica == A
    assert f"rollout r1: writing its replica pin ({A}) failed" in caplog.text
