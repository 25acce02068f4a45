"""Progress bars for the long store commands (`inspect --verify`, `gc`, `compact`, `export`).

A bar is drawn on stderr, and only when stderr is a terminal: piped or redirected output (a CI
log, ``2> file``) gets no bar and no control characters, and stdout stays the command's own
output (its ``--json`` summary, for one). The bar is transient: it is erased when the work ends,
leaving the summary alone on the screen.

    with progress_bar("compacting") as progress:
        stats = compact_store(url, progress=progress)   # progress is None off a terminal
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import IO

from ..sinks.base import Progress

__all__ = ["progress_bar"]


@contextlib.contextmanager
def progress_bar(description: str, stream: IO[str] | None = None) -> Iterator[Progress | None]:
    """A `Progress` callback that draws a bar on `stream` (default stderr) while the block runs,
    or None when `stream` is not a terminal."""
    out = sys.stderr if stream is None else stream
    if not out.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import Progress as Bar

    bar = Bar(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=out),
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield advance
