"""Transparent huge pages for the serving process (``--transparent-huge-pages``).

A proxy runs for weeks and its memory should follow what it holds. With transparent huge pages
(THP), the kernel may back a region of the heap with 2 MiB pages whenever a library asks for it
(NumPy, which pyarrow loads, advises huge pages for every large array; allocators may too), and
``khugepaged`` later collapses the heap's partly used 4 KiB pages into them: the process's RSS
then steps up by tens of megabytes at an unpredictable minute without anything new being held
(measured in the Parquet soak: one 32-50 MB step within 40 s while the malloc heap and Python's
objects stayed flat, docs/reports/reliability.md section 6). A sidecar beside vLLM on a GPU node
has no use for huge pages (its working set is small and its work is I/O), so ``serve`` turns them
off for its own process by default; ``system`` leaves the machine's policy as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

__all__ = ["CHOICES", "apply", "thp_disabled"]

log = logging.getLogger("capture_proxy")

CHOICES = ("off", "system")

#: prctl(2) options (linux/prctl.h): no new huge pages for this process, inherited by children.
_PR_SET_THP_DISABLE = 41
_PR_GET_THP_DISABLE = 42


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    result = int(libc.prctl(option, arg, 0, 0, 0))
    if result < 0:
        raise OSError(ctypes.get_errno(), "prctl failed")
    return result


def thp_disabled() -> bool | None:
    """Whether transparent huge pages are off for this process (None: not Linux, or unknown)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return _prctl(_PR_GET_THP_DISABLE) == 1
    except OSError:
        return None


def apply(choice: str) -> None:
    """Apply ``--transparent-huge-pages``: ``off`` turns THP off for this process (Linux; logged
    where the kernel refuses), ``system`` changes nothing."""
    if choice not in CHOICES:
        raise ValueError(f"--transparent-huge-pages must be one of {', '.join(CHOICES)}")
    if choice == "system" or not sys.platform.startswith("linux"):
        return
    try:
        _prctl(_PR_SET_THP_DISABLE, 1)
    except OSError as e:
        log.warning("could not turn transparent huge pages off for this process: %s", e)
