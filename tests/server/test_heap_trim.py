"""``--malloc-trim-interval``: the serving process hands the C heap's free pages back on a loop."""

from __future__ import annotations

import asyncio
import logging
import platform

import pytest

from capture_proxy.server import heap_trim
from capture_proxy.server.heap_trim import HeapTrim
from capture_proxy.server.settings import Settings, SettingsError, load_settings

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


@glibc
def test_glibc_has_malloc_trim_and_it_runs() -> None:
    trim = heap_trim.malloc_trim()
    assert trim is not None
    trim()  # nothing to check but that it returns: what it gives back is the kernel's to count


@glibc
async def test_trims_every_interval_until_cancelled() -> None:
    trimmer = HeapTrim(0.01)
    task = asyncio.create_task(trimmer.run())
    for _ in range(500):
        if trimmer.trims >= 3:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert trimmer.trims >= 3
    assert trimmer.max_s >= trimmer.last_s


async def test_zero_never_trims() -> None:
    trimmer = HeapTrim(0.0)
    await asyncio.wait_for(trimmer.run(), timeout=5)  # returns at once: no loop is left running
    assert trimmer.trims == 0


async def test_a_c_library_without_malloc_trim_is_said_once_and_not_trimmed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # musl and macOS have no malloc_trim: stand in for them.
    monkeypatch.setattr(heap_trim, "malloc_trim", lambda: None)
    trimmer = HeapTrim(0.01)
    with caplog.at_level(logging.INFO, logger="capture_proxy"):
        await asyncio.wait_for(trimmer.run(), timeout=5)
    assert trimmer.trims == 0
    assert "this C library has no malloc_trim; not trimming" in caplog.text


def test_the_default_is_ten_seconds_and_a_negative_interval_is_named() -> None:
    assert Settings().malloc_trim_interval == 10.0
    env = "CAPTURE_PROXY_MALLOC_TRIM_INTERVAL"
    assert load_settings(environ={env: "0"}).malloc_trim_interval == 0.0
    with pytest.raises(SettingsError, match=r"--malloc-trim-interval.*must be >= 0, got -1"):
        load_settings(environ={env: "-1"})
