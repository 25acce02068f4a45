"""`gc`, `compact`, `export` and `inspect --verify`: a `--json` summary each, and a progress bar
on stderr only when stderr is a terminal (a pseudo-terminal here); the operations report their
progress through the `Progress` callback, ending at their total."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capture_proxy.read.export import export_store
from capture_proxy.read.reader import open_store
from capture_proxy.sinks.registry import compact_store, gc_store
from tests.support import ROOT
from tests.test_cli_store import run, three_rollouts


async def sealed_store(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """`three_rollouts`, with ``done`` sealed a moment ago."""
    url = await three_rollouts(kind, tmp_path)
    assert (await run(["seal", url, "done"], capsys))[0] == 0
    await asyncio.sleep(0.01)  # sealed strictly before "now" for --older-than 0s
    return url


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
@pytest.mark.parametrize("dry_run", [True, False])
async def test_gc_json_summary(
    kind: str, dry_run: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await sealed_store(kind, tmp_path, capsys)
    argv = ["gc", url, "--older-than", "0s", "--json", *(["--dry-run"] if dry_run else [])]
    code, out, err = await run(argv, capsys)
    assert (code, err) == (0, "")
    summary = json.loads(out)  # the whole of stdout is one JSON object
    assert summary["store"] == url
    assert summary["dry_run"] is dry_run
    assert summary["rollouts"] == ["done"]
    assert summary["calls"] == 2
    assert {"blobs", "attachments", "bytes_before", "bytes_after"} <= set(summary)
    with open_store(url) as store:
        assert ("done" in store.rollouts()) is dry_run


async def test_compact_json_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = await three_rollouts("parquet", tmp_path)
    code, out, err = await run(["compact", url, "--json"], capsys)
    assert (code, err) == (0, "")
    summary = json.loads(out)
    assert summary["store"] == url
    assert summary["units_before"] > summary["units_after"] == 1
    assert summary["records"] == 6  # two calls in each of three rollouts (one lost, one in ledger)
    assert {"files_before", "files_after", "bytes_before", "bytes_after", "deleted_files"} <= set(
        summary
    )


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_operations_report_progress_up_to_their_total(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await sealed_store(kind, tmp_path, capsys)
    seen: dict[str, list[tuple[int, int]]] = {"verify": [], "gc": [], "compact": [], "export": []}
    with open_store(url) as store:
        store.problems(progress=lambda done, total: seen["verify"].append((done, total)))
    export_store(
        url,
        str(tmp_path / "out.parquet"),
        include_open=True,
        progress=lambda done, total: seen["export"].append((done, total)),
    )
    if kind == "parquet":
        compact_store(url, progress=lambda done, total: seen["compact"].append((done, total)))
    else:
        seen.pop("compact")
    now = int(time.time() * 1000)
    gc_store(
        url,
        older_than_ms=0,
        now_ms=now,
        progress=lambda done, total: seen["gc"].append((done, total)),
    )
    for name, steps in seen.items():
        assert steps, name
        assert steps[-1][0] == steps[-1][1], (name, steps)  # ends complete
        assert [d for d, _ in steps] == sorted(d for d, _ in steps), (name, steps)
        assert all(0 <= d <= t for d, t in steps), (name, steps)


def _run_with_stderr_on_a_terminal(argv: list[str]) -> tuple[int, str, str]:
    """Run the command with stderr on a pseudo-terminal, stdout on a pipe."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "capture_proxy", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "COLUMNS": "100", "TERM": "xterm"},
    )
    os.close(slave)
    terminal = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError as e:  # EIO: the child closed its end
            if e.errno != errno.EIO:
                raise
            break
        if not chunk:
            break
        terminal += chunk
    os.close(master)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    proc.stdout.close()
    return proc.wait(timeout=60), out, terminal.decode(errors="replace")


async def test_a_terminal_gets_a_bar_and_a_pipe_gets_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = await sealed_store("parquet", tmp_path, capsys)
    argv = ["inspect", url, "--verify", "--json"]
    code, out, terminal = await asyncio.to_thread(_run_with_stderr_on_a_terminal, argv)
    assert code == 0, terminal
    assert "verifying" in terminal
    assert "━" in terminal  # rich's bar
    assert json.loads(out)["ok"] is True  # stdout stays the summary alone

    piped = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "capture_proxy", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert piped.returncode == 0
    assert piped.stderr == ""  # no bar, no control characters
    assert json.loads(piped.stdout)["ok"] is True

    code, out, terminal = await asyncio.to_thread(
        _run_with_stderr_on_a_terminal, ["gc", url, "--older-than", "0s", "--json"]
    )
    assert code == 0, terminal
    assert "removing" in terminal
    assert json.loads(out)["rollouts"] == ["done"]

    code, out, terminal = await asyncio.to_thread(
        _run_with_stderr_on_a_terminal,
        ["export", url, str(tmp_path / "x.parquet"), "--include-open", "--json"],
    )
    assert code == 0, terminal
    assert "exporting" in terminal
    assert json.loads(out)["rows"] > 0
