"""How a load generator hands its result to `bench_proxy.py`.

A file, not stdout: libuv (uvloop) leaves the pipe it was given non-blocking, and a fast closed
loop's result (its per-call latencies, over 128 KiB) was cut short by a partial write.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import orjson


def write_result(result: dict[str, Any], out: str | None) -> None:
    """Write `result` as JSON to the file `out` (atomically), or to stdout when `out` is None."""
    data = orjson.dumps(result)
    if out is None:
        os.set_blocking(sys.stdout.fileno(), True)
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    path = Path(out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
