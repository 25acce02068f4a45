"""Structured logs: one JSON object per line, with the rollout and call ids when there are any.

Request bodies and secrets are never logged: handlers log ids, statuses and timings, and the
settings are logged through `Settings.public()`, which masks secrets.

Warnings and errors are logged once per kind and interval, not once per event (`RepeatFilter`): a
storm (descriptors exhausted, a flood of refused connections, a failing store) logs a few lines
and then one count per interval, instead of a traceback per event.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["JsonFormatter", "RepeatFilter", "TextFormatter", "flush_repeats", "setup_logging"]

#: `extra=` keys copied into the JSON object when a log call provides them. ``settings`` is the
#: start-up settings (`Settings.public()`), kept an object so a log pipeline can query its keys.
_FIELDS = (
    "rollout_id",
    "call_id",
    "status",
    "route",
    "http_status",
    "duration_ms",
    "reason",
    "settings",
    "store_head",
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


@dataclass
class _Window:
    start: float
    passed: int = 1
    held: int = 0


class RepeatFilter(logging.Filter):
    """Pass at most `burst` warnings or errors of one kind per `interval` seconds.

    A kind is the logger, the level, the message before its arguments are filled in and the
    exception's type, so "refused a connection", "accept(): too many open files" and one failing
    store call are three kinds however many times each happens. Records beyond the burst are
    counted, not written; the next record of that kind after the interval says how many were
    held back, and so does `flush` (``capture-proxy serve`` calls it every interval), so a storm
    that stops is still counted. Records below WARNING (the access log) always pass.
    """

    def __init__(self, interval: float = 10.0, burst: int = 3) -> None:
        super().__init__()
        self.interval = interval
        self.burst = burst
        self._windows: dict[tuple[str, int, str, str], _Window] = {}
        self._lock = threading.Lock()  # the store's writer thread logs too

    @staticmethod
    def _kind(record: logging.LogRecord) -> tuple[str, int, str, str]:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        return record.name, record.levelno, str(record.msg), exc

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = self._kind(record)
        now = time.monotonic()
        with self._lock:
            window = self._windows.get(kind)
            if window is None or now - window.start >= self.interval:
                if len(self._windows) > 1000:  # bounded: forget quiet kinds
                    self._windows = {
                        k: w for k, w in self._windows.items() if now - w.start < self.interval
                    }
                self._windows[kind] = _Window(now)
                if window is not None and window.held:
                    record.msg = f"{record.msg} [{window.held} more like this not logged]"
                return True
            if window.passed < self.burst:
                window.passed += 1
                return True
            window.held += 1
            return False

    def flush(self, *, all_windows: bool = False) -> None:
        """Log how many records of each kind were held back in windows that have ended (in every
        window with `all_windows`, as at exit)."""
        now = time.monotonic()
        due: list[tuple[tuple[str, int, str, str], int, float]] = []
        with self._lock:
            for kind, window in list(self._windows.items()):
                if all_windows or now - window.start >= self.interval:
                    del self._windows[kind]
                    if window.held:
                        due.append((kind, window.held, now - window.start))
        for (name, level, msg, _), held, span in due:
            first_line = msg.splitlines()[0] if msg else ""
            logging.getLogger(name).log(
                level, "%d more like this not logged in %.0fs: %s", held, span, first_line
            )


def flush_repeats(*, all_windows: bool = False) -> None:
    """`RepeatFilter.flush` on every filter of the root logger's handlers."""
    for handler in logging.getLogger().handlers:
        for f in handler.filters:
            if isinstance(f, RepeatFilter):
                f.flush(all_windows=all_windows)


class TextFormatter(logging.Formatter):
    """Plain lines for people: the message, then the same `extra=` fields as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = []
        for key in _FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                text = value if isinstance(value, str) else orjson.dumps(value, default=str)
                fields.append(f"{key}={text if isinstance(text, str) else text.decode()}")
        if not fields:
            return line
        # The traceback, if any, stays last: fields go at the end of the first line.
        head, sep, rest = line.partition("\n")
        return f"{head} {' '.join(fields)}{sep}{rest}"


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RepeatFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
