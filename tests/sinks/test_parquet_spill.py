"""A long-lived reader's per-key index bytes move to mapped files (`_spill.SpillingBytes`), so
its memory does not grow with the store: every key is still found where it was added, reads
on another thread never miss a key added before them, a temporary folder that refuses the
bytes keeps them in memory (a real store's units reader with its index in files:
tests/sinks/test_parquet_locator.py)."""

from __future__ import annotations

import logging
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.sinks.parquet import _spill
from capture_proxy.sinks.parquet._keyed import Locator, Packed
from capture_proxy.sinks.parquet._spill import SpillingBytes


def _reference_find(data: bytes, pattern: bytes, step: int) -> list[int]:
    return [i for i in range(0, len(data) - len(pattern) + 1, step) if data.startswith(pattern, i)]


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(st.integers(0, 5), min_size=1, max_size=300),
    spill=st.sampled_from([8, 24, 64, 256]),
)
def test_found_and_read_as_one_string_whatever_is_in_files(records: list[int], spill: int) -> None:
    """Records of 8 bytes drawn from six values (so patterns repeat), appended one or three at
    a time: every search and read answers what the same bytes in memory answer."""
    spilled, plain = SpillingBytes(spill), bytearray()
    values = [bytes([v]) * 8 for v in range(6)]
    i = 0
    while i < len(records):
        chunk = b"".join(values[v] for v in records[i : i + 1 + i % 3])
        i += 1 + i % 3
        spilled.append(chunk)
        plain += chunk
    assert len(spilled) == len(plain)
    assert spilled.memory_bytes() < spill + 24
    for v in values:
        want = _reference_find(bytes(plain), v, 8)
        assert list(spilled.find_aligned(v, 8)) == want
        assert list(spilled.find_aligned(v, 8, newest_first=True)) == want[::-1]
    for pos in range(0, len(plain), 8):
        assert spilled.read(pos, pos + 8) == bytes(plain[pos : pos + 8])


def test_files_are_merged_so_they_stay_few() -> None:
    spilled = SpillingBytes(64)
    for n in range(20_000):
        spilled.append(n.to_bytes(8, "little"))
    # 2,500 spills of 64 bytes: merged two into one while the older is at most twice the newer.
    assert spilled.files() <= 16
    assert spilled.memory_bytes() < 64
    assert list(spilled.find_aligned((12_345).to_bytes(8, "little"), 8)) == [12_345 * 8]


def test_a_locator_in_files_finds_every_key_at_each_place_and_holds_only_its_runs() -> None:
    loc, places = Locator(spill_bytes=256), {}
    for unit in range(600):
        for k in range(unit % 9):
            key = f"k{unit}-{k}"
            loc.add(key, unit, unit % 3)
            places[key] = (unit, unit % 3)
    loc.add("k7-0", 900, 1)  # a second copy, later (most likely in another file)
    assert loc.files() > 0
    for key, place in places.items():
        found = list(loc.find(key))
        assert found == ([place, (900, 1)] if key == "k7-0" else [place])
    assert list(loc.find("k7-0", newest_first=True)) == [(900, 1), (7, 1)]
    assert list(loc.find("never added")) == []
    # In memory: the hashes not yet in a file and 12 bytes a run (the 8 bytes a key are not).
    assert loc.nbytes() <= 256 + 8 + 12 * 601


def test_packed_values_round_trip_across_files() -> None:
    rng = random.Random(7)
    packed, plain = Packed(low_bits=32, spill_bytes=128), Packed(low_bits=32, spill_bytes=0)
    added: dict[str, list[int]] = {}
    for r in range(2_000):
        values = sorted(rng.randrange(1 << 20) << 32 | rng.randrange(4) for _ in range(r % 6))
        packed.add(f"r{r}", values)
        plain.add(f"r{r}", values)
        added[f"r{r}"] = values
    assert packed.nbytes() < 2 * 128 + 32
    for key, values in added.items():
        assert packed.find(key) == values == plain.find(key)
    assert packed.find("never") == []


def test_a_temporary_folder_that_refuses_keeps_the_bytes_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    loc = Locator(spill_bytes=64)
    with caplog.at_level(logging.WARNING, logger="capture_proxy"):
        for n in range(40):
            loc.add(f"k{n}", n, 0)
    assert loc.files() == 0
    # Tried at 64, 128 and 256 bytes of hashes (the next try once they have doubled).
    refused = [r for r in caplog.records if "index bytes stay in memory" in r.getMessage()]
    assert len(refused) == 3
    assert "missing" in refused[0].getMessage()
    (tmp_path / "missing").mkdir()
    for n in range(40, 80):
        loc.add(f"k{n}", n, 0)
    assert loc.files() > 0
    assert all(list(loc.find(f"k{n}")) == [(n, 0)] for n in range(80))


def test_a_merge_that_fails_keeps_the_bytes_in_memory_and_loses_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The spill's own file is written but merging it with the file before fails (the disk
    filled in between): the bytes stay in memory, the files are as they were, every key is
    found, and once files can be written again they move out."""
    loc = Locator(spill_bytes=64)
    for n in range(8):  # 64 bytes: the first file
        loc.add(f"k{n}", n, 0)
    assert loc.files() == 1
    write, calls = _spill._write, [0]

    def full_after_one(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > 1:  # the spill's file, then the merge's
            raise OSError(28, "No space left on device")
        return write(*args, **kwargs)

    monkeypatch.setattr(_spill, "_write", full_after_one)
    with caplog.at_level(logging.WARNING, logger="capture_proxy"):
        for n in range(8, 16):
            loc.add(f"k{n}", n, 0)
    assert loc.files() == 1
    assert loc._hashes.memory_bytes() == 64
    assert any("No space left" in r.getMessage() for r in caplog.records)
    assert all(list(loc.find(f"k{n}")) == [(n, 0)] for n in range(16))
    monkeypatch.setattr(_spill, "_write", write)
    for n in range(16, 32):  # 128 bytes in memory: the next attempt, which succeeds
        loc.add(f"k{n}", n, 0)
    assert loc._hashes.memory_bytes() < 64
    assert all(list(loc.find(f"k{n}")) == [(n, 0)] for n in range(32))


def test_a_find_on_another_thread_meets_every_key_added_before_it() -> None:
    """Keys added (and moved to files, and merged) on one thread while another looks up keys
    already added: none is ever missed."""
    loc, added, stop = Locator(spill_bytes=64), [0], threading.Event()
    misses: list[int] = []

    def writer() -> None:
        for n in range(20_000):
            loc.add(f"k{n}", n, 0)
            added[0] = n + 1
            if stop.is_set():
                return

    t = threading.Thread(target=writer)
    t.start()
    rng, deadline = random.Random(3), time.monotonic() + 10.0
    try:
        while t.is_alive() and time.monotonic() < deadline:
            n = added[0]
            if n:
                k = rng.randrange(n)
                if list(loc.find(f"k{k}")) != [(k, 0)]:
                    misses.append(k)
    finally:
        stop.set()
        t.join()
    assert misses == []
    assert loc.files() > 0
