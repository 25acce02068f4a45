"""Warnings and errors are logged once per kind and interval, with a count of the rest
(`capture_proxy.logs.RepeatFilter`): a storm of one failure writes a few lines, not one per event
(issue 19: at the open-file limit the proxy wrote 19 MB of tracebacks in 30 s)."""

from __future__ import annotations

import io
import logging
import re
import time
from collections.abc import Iterator

import pytest

from capture_proxy.logs import JsonFormatter, RepeatFilter


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO, RepeatFilter]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    repeats = RepeatFilter(interval=0.2, burst=3)
    handler.addFilter(repeats)
    logger = logging.getLogger("capture_proxy.test_repeats")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield logger, out, repeats
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def test_a_storm_of_one_error_is_a_few_lines_and_a_count(
    logged: tuple[logging.Logger, io.StringIO, RepeatFilter],
) -> None:
    log, out, repeats = logged
    repeats.interval = 60.0  # the whole storm in one window, however slow the machine
    for i in range(10_000):
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            log.exception("accept() failed on fd %d", i)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    repeats.flush(all_windows=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert re.search(r"9997 more like this not logged in \d+s: accept\(\) failed on fd", lines[-1])


def test_the_next_record_after_the_interval_says_how_many_were_held_back(
    logged: tuple[logging.Logger, io.StringIO, RepeatFilter],
) -> None:
    log, out, _ = logged
    for _ in range(5):
        log.warning("refused a client connection")
    time.sleep(0.25)
    log.warning("refused a client connection")
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert "refused a client connection [2 more like this not logged]" in lines[-1]


def test_kinds_are_counted_apart_and_info_always_passes(
    logged: tuple[logging.Logger, io.StringIO, RepeatFilter],
) -> None:
    log, out, _ = logged
    log.setLevel(logging.INFO)
    for _ in range(10):
        log.warning("one kind")
        log.error("another kind")
        log.info("an access line")
    text = out.getvalue()
    assert text.count("one kind") == 3
    assert text.count("another kind") == 3
    assert text.count("an access line") == 10


def test_flush_at_exit_reports_windows_still_open(
    logged: tuple[logging.Logger, io.StringIO, RepeatFilter],
) -> None:
    log, out, repeats = logged
    for _ in range(7):
        log.warning("disk floor reached")
    repeats.flush()  # the window is still open: nothing to report yet
    assert out.getvalue().count("\n") == 3
    repeats.flush(all_windows=True)
    assert "4 more like this not logged" in out.getvalue().splitlines()[-1]
