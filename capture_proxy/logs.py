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

__all__ = ["JsonFormatter", "setup_logging"]

#: `extra=` keys copied into the JSON object when a log call provides them.
_FIELDS = ("rollout_id", "call_id", "status", "route", "http_status", "duration_ms", "reason")


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


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
