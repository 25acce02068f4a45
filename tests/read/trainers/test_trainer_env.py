"""The cached test environments (scripts/cached_env.py, as scripts/trainer_env.py uses it): a
failed install step fails with the installer's own output, and a venv is trusted only when its
marker records this recipe."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scripts import trainer_env
from scripts.cached_env import read_marker, run_step


def test_a_failed_install_step_raises_with_the_installers_reason(tmp_path: Path) -> None:
    log = tmp_path / "prepare.log"
    fail = "import sys; print('ERROR: No matching distribution found for verl==9.9'); sys.exit(1)"
    with pytest.raises(
        RuntimeError, match=r"(?s)failed with exit 1; log .*\nERROR: No matching distribution"
    ):
        run_step([sys.executable, "-c", fail], log)
    assert "No matching distribution found for verl==9.9" in log.read_text()


def test_a_venv_is_reused_only_when_its_marker_records_this_recipe(tmp_path: Path) -> None:
    paths = trainer_env.Paths(tmp_path)
    paths.venv.mkdir(parents=True)
    assert read_marker(paths.marker) is None  # interrupted install: rebuilt
    paths.marker.write_text(json.dumps({**trainer_env.recipe(), "recipe": 0}))
    assert read_marker(paths.marker) != trainer_env.recipe()
    paths.marker.write_text(json.dumps(trainer_env.recipe()))
    # A marker of this recipe: prepare() returns at once, installing nothing.
    assert trainer_env.prepare(tmp_path).python == paths.python
