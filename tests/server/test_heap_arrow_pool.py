"""``serve`` makes Arrow's C++ default pool glibc's malloc before pyarrow is imported
(`heap_trim.arrow_on_malloc`): the Parquet writer's encoders take that pool whatever
`pyarrow.set_memory_pool` chose, and mimalloc, pyarrow's default, kept what it freed resident
(docs/reports/reliability.md, eleventh round). An operator's ``ARROW_DEFAULT_MEMORY_POOL`` wins.
Seen in a real process writing through a real Parquet sink, by mimalloc's own counter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from capture_proxy.server.heap_trim import arrow_on_malloc

_STAGE_THEN_COUNT = textwrap.dedent(
    """
    import asyncio, sys
    from capture_proxy.server.heap_trim import arrow_on_malloc
    said = arrow_on_malloc() if sys.argv[1] == "serve" else None
    import pyarrow as pa
    from tests.support.sink_factories import Session, stage_parquet
    staged = asyncio.run(stage_parquet(sys.argv[2], [Session("r")], 3))
    print(said, len(staged), pa.mimalloc_memory_pool().max_memory())
    """
)
_ROOT = Path(__file__).resolve().parents[2]


def _stage(tmp_path: Path, mode: str, env: dict[str, str]) -> tuple[str, int, int]:
    done = subprocess.run(
        [sys.executable, "-c", _STAGE_THEN_COUNT, mode, str(tmp_path / mode)],
        capture_output=True,
        text=True,
        env=env,
        cwd=_ROOT,
        check=True,
    )
    said, staged, peak = done.stdout.split()
    return said, int(staged), int(peak)


def test_the_parquet_writer_allocates_nothing_from_mimalloc_once_serve_chose_malloc(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    _, staged, peak = _stage(tmp_path, "library", env)
    assert staged == 3
    assert peak > 0  # a library user's process: pyarrow's own default
    said, staged, peak = _stage(tmp_path, "serve", env)
    assert (said, staged, peak) == ("True", 3, 0)


def test_an_operators_arrow_default_memory_pool_is_left_alone(tmp_path: Path) -> None:
    environ = {"ARROW_DEFAULT_MEMORY_POOL": "mimalloc"}
    assert arrow_on_malloc(environ) is False
    assert environ == {"ARROW_DEFAULT_MEMORY_POOL": "mimalloc"}
    said, staged, peak = _stage(tmp_path, "serve", {**os.environ, **environ})
    assert (said, staged) == ("False", 3)
    assert peak > 0


def test_nothing_is_changed_once_pyarrow_is_imported() -> None:
    import pyarrow  # noqa: F401  (Arrow chose its pool at this import)

    environ: dict[str, str] = {}
    assert arrow_on_malloc(environ) is False
    assert environ == {}
