"""The README's "From rollout to trainer" runs as written: its code block, taken verbatim, is run
by bash in an empty folder, as a new user pastes it into a fresh clone, and the export it ends
with holds the graded rollout. Whatever it left running is stopped afterwards."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq

from capture_proxy import open_store

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### From rollout to trainer"
BATCHES = "### Trainers, live: batches, and the whole RL loop"


def code_block(heading: str) -> str:
    """The first indented code block after `heading` in README.md, dedented."""
    lines = (ROOT / "README.md").read_text().splitlines()
    at = lines.index(heading)
    block: list[str] = []
    for line in lines[at + 1 :]:
        if line.startswith("    "):
            block.append(line)
        elif block and line.strip():
            break  # the first prose line after the block ends it
        elif block:
            block.append(line)
    assert block, f"README.md has no code block under {heading!r}"
    return textwrap.dedent("\n".join(block)).strip() + "\n"


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_trainer_path_runs_when_pasted_and_exports_the_graded_rollout(
    tmp_path: Path,
) -> None:
    script = code_block(SECTION)
    ports = sorted({int(p) for p in re.findall(r"(?:--port |localhost:)(\d+)", script)})
    assert ports, script
    taken = [p for p in ports if _port_taken(p)]
    assert not taken, f"the README's ports {taken} are in use on this machine: stop what holds them"
    # As in a clone: `.venv/bin/...` is the environment running these tests.
    (tmp_path / ".venv").symlink_to(sys.prefix)
    assert (tmp_path / ".venv" / "bin" / "capture-proxy").exists()
    # A session of its own: the background servers the lines start share its process group,
    # which is killed below whatever the lines did. Output to files, not pipes: a server left
    # running would hold a pipe open.
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out_path.open("w") as out_file, err_path.open("w") as err_file:
        proc = subprocess.Popen(
            ["bash", "-e", "-c", script],
            cwd=tmp_path,
            stdout=out_file,
            stderr=err_file,
            start_new_session=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("CAPTURE_PROXY_")},
        )
        try:
            proc.wait(timeout=120)
            # The closing `kill` stops both servers: their ports close once they have shut down.
            deadline = time.monotonic() + (30 if proc.returncode == 0 else 0)
            while (still := [p for p in ports if _port_taken(p)]) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = out_path.read_text()
    shown = "".join(
        f"\n--- {name}\n{(tmp_path / name).read_text()}"
        for name in ("stdout.txt", "stderr.txt", "proxy.log", "vllm.log")
        if (tmp_path / name).exists()
    )
    assert proc.returncode == 0, shown

    rows = pq.read_table(tmp_path / "segments.parquet").to_pylist()
    assert [(r["rollout_id"], r["group_id"], r["reward"], r["state"]) for r in rows] == [
        ("ep-7", "prompt-3", 1.0, "sealed")
    ]
    assert rows[0]["prompt_ids"]
    assert rows[0]["response_ids"]
    assert "wrote 1 row(s) of 1 rollout(s) to segments.parquet" in out
    assert "ep-7" in out  # the table the last line prints
    assert not still, f"the README's closing kill left ports {still} open"

    # The next section's batch, on the store those lines wrote: ep-7, once.
    batch = subprocess.run(
        ["bash", "-e", "-c", code_block(BATCHES)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert batch.returncode == 0, batch.stderr
    assert batch.stdout.startswith("('ep-7',) "), batch.stdout
    with open_store(f"sqlite:///{tmp_path / 'trainer.db'}") as store:
        # Acknowledged: never delivered to trainer-a again; another consumer gets it.
        assert store.next_batch("trainer-a", rollouts=1, wait_s=0) is None
        other = store.next_batch("trainer-b", rollouts=1, wait_s=0)
        assert other is not None
        assert other.rollout_ids == ("ep-7",)
