"""Log lines: JSON objects whose fields a pipeline can query, or plain text with the same fields."""

from __future__ import annotations

import json
import logging
import sys

from capture_proxy.logs import JsonFormatter, TextFormatter

SETTINGS = {"port": 8100, "store": "sqlite:///capture.db", "admin_token": "***"}


def _record(msg: str, **extra: object) -> logging.LogRecord:
    return logging.makeLogRecord(
        {"name": "capture_proxy", "levelname": "INFO", "levelno": 20, "msg": msg, **extra}
    )


def test_json_lines_carry_the_start_up_settings_as_an_object() -> None:
    line = JsonFormatter().format(_record("starting", settings=SETTINGS))
    entry = json.loads(line)
    assert entry["msg"] == "starting"
    assert entry["settings"] == SETTINGS  # an object, not a Python dict's repr inside a string
    assert "{" not in entry["msg"]


def test_json_lines_leave_out_fields_a_call_did_not_give() -> None:
    entry = json.loads(JsonFormatter().format(_record("hello", rollout_id="r1")))
    assert entry["rollout_id"] == "r1"
    assert "settings" not in entry
    assert "call_id" not in entry


def test_text_lines_append_the_fields_as_key_value() -> None:
    line = TextFormatter().format(_record("starting", settings=SETTINGS, rollout_id="r1"))
    assert " INFO capture_proxy starting " in line
    assert "rollout_id=r1" in line
    _, _, settings = line.partition("settings=")
    assert json.loads(settings) == SETTINGS


def test_text_lines_keep_a_traceback_after_the_fields() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = _record("failed", call_id="c1", exc_info=sys.exc_info())
    first, _, rest = TextFormatter().format(record).partition("\n")
    assert first.endswith("failed call_id=c1")
    assert rest.startswith("Traceback")
    assert "RuntimeError: boom" in rest
