"""``serve`` lets glibc make two malloc arenas, not eight per core (`heap_trim.limit_arenas`):
each arena keeps free runs only its own threads reuse, and a proxy's many threads kept more free
heap than with two (docs/reports/reliability.md, section 6). An operator's ``MALLOC_ARENA_MAX``
wins. Counted in a real process with threads that allocate, by glibc's own ``malloc_info``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from capture_proxy.server.heap_trim import limit_arenas

_THREADS_THEN_COUNT = textwrap.dedent(
    """
    import ctypes, sys, threading
    from capture_proxy.server.heap_trim import limit_arenas
    limited = limit_arenas() if sys.argv[1] == "limit" else None
    ready = threading.Barrier(8)
    held = []

    def work():
        ready.wait()  # all at once: each would get an arena of its own
        held.append([bytearray(200) for _ in range(2000)])

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    f = libc.fopen(sys.argv[2].encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    print(limited)
    """
)


def _arenas(tmp_path: Path, mode: str, env: dict[str, str]) -> tuple[int, str]:
    out = tmp_path / f"{mode}.xml"
    done = subprocess.run(
        [sys.executable, "-c", _THREADS_THEN_COUNT, mode, str(out)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return out.read_text().count("<heap nr="), done.stdout.strip()


def test_threads_share_two_malloc_arenas_once_limited(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    unlimited, _ = _arenas(tmp_path, "default", env)
    limited, said = _arenas(tmp_path, "limit", env)
    assert unlimited > 2  # glibc's default: a thread that meets others gets an arena
    assert (limited, said) == (2, "True")


def test_an_operators_malloc_arena_max_is_left_alone(tmp_path: Path) -> None:
    assert limit_arenas(environ={"MALLOC_ARENA_MAX": "4"}) is False
    env = {**os.environ, "MALLOC_ARENA_MAX": "3"}
    arenas, said = _arenas(tmp_path, "limit", env)
    assert said == "False"
    assert arenas <= 3
