"""CPU time and peak memory of another process, from /proc (Linux; no psutil).

`cpu_seconds(pid)` is user + system time of every thread of the process (fields 14 and 15 of
``/proc/<pid>/stat``, in clock ticks). `reset_peak_rss(pid)` writes ``5`` to
``/proc/<pid>/clear_refs`` (Linux >= 4.0) so that ``VmHWM`` in ``/proc/<pid>/status`` measures the
peak of the next phase only; `peak_rss_mb` reads it. Where the reset is not permitted, the peak
is over the process's whole life, which `reset_peak_rss` reports by returning False.
"""

from __future__ import annotations

import os

__all__ = ["cpu_seconds", "cpu_seconds_fine", "peak_rss_mb", "reset_peak_rss", "rss_mb"]

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # The command name (field 2) may hold spaces: split after its closing parenthesis.
    fields = stat[stat.rindex(b")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _TICKS


def cpu_seconds_fine(pid: int) -> float:
    """`cpu_seconds` to the nanosecond: the sum of ``/proc/<pid>/task/*/schedstat``'s first field
    (time on a CPU) over the threads alive now, for figures too small for clock ticks (an idle
    process's milliseconds a second). A thread that ended takes its time with it."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # ended since the listing
            continue
    return total / 1e9


def _status_kb(pid: int, key: bytes) -> int:
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key.decode())


def peak_rss_mb(pid: int) -> float:
    return _status_kb(pid, b"VmHWM:") / 1024


def rss_mb(pid: int) -> float:
    return _status_kb(pid, b"VmRSS:") / 1024


def reset_peak_rss(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
