"""Structured logs: one JSON object per line, with the rollout and call ids when there are any.

Request bodies and secrets are never logged: handlers log ids, statuses and timings, and the
settings are logged through `Settings.public()`, which masks secrets.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

__all__ = ["JsonFormatter", "TextFormatter", "setup_logging"]

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
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
