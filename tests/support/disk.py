"""A disk that really fills: a small tmpfs (root only; the test is skipped, saying why, where
mounting is refused) and a file that takes its last free byte."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["fill", "tmpfs"]


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (``4m``) mounted at `where` for the block; unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the simulated runs")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill the filesystem of `folder` until at most `leave` bytes are free; the filler file."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close

        def free() -> int:
            st = os.statvfs(folder)
            return st.f_bavail * st.f_frsize

        with contextlib.suppress(OSError):  # ENOSPC: as full as it gets
            while free() > leave:
                f.write(b"\0" * 16384)
                f.flush()
    assert free() <= max(leave, 16384)
    return filler
