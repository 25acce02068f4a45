"""A cached environment with the trainers' own packages (verl, SkyRL), for the adapter tests.

The tests hold what `capture_proxy.read.trainers` hands over to the trainers' own classes and
validators, run in this environment through a subprocess (tests/support/trainer_check.py): our
package never imports a trainer, and a trainer's dependencies never enter the project's venv.

    python scripts/trainer_env.py prepare [--cache DIR]

From Python (the test suite)::

    from scripts.trainer_env import prepare
    python = prepare().python        # the venv's interpreter; installed on first use

The cache (default `$CAPTURE_PROXY_CACHE`, else `~/.cache/capture-proxy`) holds the venv in
`trainers/venv` and the install log in `trainers/logs`. The venv is rebuilt when its marker file
is missing or records another recipe, so an interrupted install is never trusted.

What is installed, and why (Python 3.11, CPU only; docs/trainers.md):
- torch 2.13.0 first and pinned: the CPU wheel on disk (as scripts/tiny_vllm.py does); left to a
  resolver, a trainer's requirements could pull a multi-GB CUDA build.
- `verl` 0.9.1 and `skyrl` 0.3.0 without their dependencies (`--no-deps`): their full
  requirements bring GPU stacks (flash-attn, vLLM, megatron, wandb, ...) that no validator needs.
- then exactly what importing `verl.experimental.agent_loop.agent_loop`, `verl.protocol`,
  `verl.trainer.ppo.core_algos`, `skyrl.train.generators.base` and
  `skyrl.train.utils.trainer_utils` needs, found by experiment, pinned (`REQUIREMENTS`).
  `skyrl-train` has no build for Python 3.11; `skyrl` 0.3.0 carries `skyrl/train/generators/`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

if __package__ in (None, ""):  # run by path (python scripts/...py): the repo root holds `scripts`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.cached_env import CachePaths, default_cache, locked, read_marker, run_step

TORCH_VERSION = "2.13.0"
VERL_VERSION = "0.9.1"
SKYRL_VERSION = "0.3.0"
# Bump when the install steps change: a venv whose marker records another recipe is rebuilt.
VENV_RECIPE = 1
# Installed with their dependencies (resolved beside the pinned torch). Each is imported by a
# module the checks use; versions are those that resolved on 2026-12-04.
REQUIREMENTS = (
    f"torch=={TORCH_VERSION}",
    # verl: transformers <5.11 (verl) and <=5.8.0 (skyrl); tensordict <=0.10 (verl).
    "transformers==5.8.0",
    "tensordict==0.10.0",
    "ray==2.60.0",
    "omegaconf==2.3.1",
    "hydra-core==1.3.8",
    "pydantic==2.14.4",
    "numpy==2.4.6",
    "pillow==13.0.0",
    "codetiming==1.4.0",
    "datasets==5.2.0",
    "cachetools==8.0.2",
    "fastapi==0.165.0",
    "uvicorn==0.55.0",
    # skyrl.train.utils.trainer_utils (its imports reach skyrl's inference client: aiohttp)
    "aiohttp==3.14.5",
    "loguru==0.7.3",
    "jaxtyping==0.3.11",
    "torchdata==0.11.0",
    "skyrl-gym==0.4.0",
)
# The trainers' modules the checks import: the install fails here, with the import's own error,
# rather than in a test.
SMOKE = ("from tests.support.trainer_check import import_trainers; import_trainers()",)


@dataclass(frozen=True)
class Paths(CachePaths):
    """Where `prepare` puts things inside the cache: the venv (run the trainer checks with its
    `python`) and the install log."""

    name: ClassVar[str] = "trainers"


def recipe() -> dict[str, object]:
    """What the marker records: a venv built from another recipe is rebuilt."""
    return {
        "recipe": VENV_RECIPE,
        "verl": VERL_VERSION,
        "skyrl": SKYRL_VERSION,
        "requirements": list(REQUIREMENTS),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _install(paths: Paths) -> None:
    import shutil

    shutil.rmtree(paths.venv, ignore_errors=True)
    log = paths.logs / "prepare.log"
    log.write_text("")
    run_step([sys.executable, "-m", "venv", str(paths.venv)], log)
    pip = [str(paths.python), "-m", "pip", "install", "--progress-bar", "off"]
    # torch first and alone: this machine's pip takes the CPU wheel that lies on disk.
    run_step([*pip, f"torch=={TORCH_VERSION}"], log)
    run_step(
        [*pip, "--no-deps", f"verl=={VERL_VERSION}", f"skyrl=={SKYRL_VERSION}"],
        log,
    )
    run_step([*pip, *REQUIREMENTS], log)
    repo = Path(__file__).resolve().parents[1]
    for code in SMOKE:
        run_step([str(paths.python), "-c", code], log, cwd=repo)
    paths.marker.write_text(json.dumps(recipe()))


def prepare(cache_dir: Path | None = None) -> Paths:
    """Build (or reuse) the trainers' venv in `cache_dir`; return where it is.

    The first run installs from the package registry (minutes: docs/trainers.md gives the
    figure); later runs read one marker file. Raises RuntimeError with the installer's output
    when a step fails.
    """
    paths = Paths(Path(cache_dir) if cache_dir else default_cache())
    paths.logs.mkdir(parents=True, exist_ok=True)
    with locked(paths.root / ".lock"):
        if read_marker(paths.marker) != recipe():
            _install(paths)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer_env.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    cmd = sub.add_parser("prepare")
    cmd.add_argument("--cache", type=Path, default=None, help="default: $CAPTURE_PROXY_CACHE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    began = time.monotonic()
    paths = prepare(args.cache)
    print(f"prepared {paths.venv} in {time.monotonic() - began:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
