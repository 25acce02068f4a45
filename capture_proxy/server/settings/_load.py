"""`load_settings`: each setting from its flag, else its environment variable, else the config
file, else its default."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tomllib
from collections.abc import Mapping
from typing import Any, get_type_hints

import orjson

from ._checks import _check
from ._fields import ENV_PREFIX, Settings, SettingsError, _env, _flag, _kind

log = logging.getLogger("capture_proxy")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _convert(kind: type, raw: Any, source: str) -> Any:
    """Convert a flag or environment string (or a TOML value) to the setting's type."""
    if kind is dict:
        value = raw
        if isinstance(raw, str):
            try:
                value = orjson.loads(raw) if raw.strip() else {}
            except orjson.JSONDecodeError as e:
                raise SettingsError(f"{source} must be a JSON object: {e}") from e
        if not isinstance(value, dict):
            raise SettingsError(f"{source} must be a JSON object (a table in TOML), got {raw!r}")
        return value
    if type(raw) is kind:
        return raw
    if kind is float and type(raw) is int:  # TOML's 10 for a float setting
        return float(raw)
    if not isinstance(raw, str):
        raise SettingsError(f"{source} must be a {kind.__name__}, got {raw!r}")
    if kind is str:
        return raw
    text = raw.strip()
    try:
        if kind is bool:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        pass
    raise SettingsError(f"{source} must be a {kind.__name__}, got {raw!r}")


def _joined(raw: Any, source: str) -> Any:
    """A list setting's value as one comma-joined string: a repeated flag gives a list, TOML an
    array (or a string), the environment a comma-separated string."""
    if isinstance(raw, list):
        if not all(isinstance(v, str) for v in raw):
            raise SettingsError(f"{source} must be a list of strings, got {raw!r}")
        return ",".join(raw)
    return raw


def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise SettingsError(f"--config: no such file {path}") from exc
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"--config {path} is not valid TOML: {e}") from e
    names = {f.name for f in dataclasses.fields(Settings)}
    for key in data:
        if key not in names:
            raise SettingsError(
                f"--config {path}: unknown setting {key!r} (settings are the flags' names "
                "in snake_case, e.g. stage_timeout)"
            )
    return data


def load_settings(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Build `Settings`: flag > environment > config file (``--config``) > default."""
    environ = os.environ if environ is None else environ
    config_path = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
    config = _read_config(config_path) if config_path else {}
    hints = get_type_hints(Settings)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        flag_value = getattr(args, f.name, None) if args is not None else None
        if flag_value is not None:
            raw, source = flag_value, _flag(f.name)
        elif _env(f.name) in environ:
            raw, source = environ[_env(f.name)], f"{_env(f.name)}"
        elif f.name in config:
            raw, source = config[f.name], f"{f.name} in {config_path}"
        else:
            continue
        if f.metadata["many"]:
            raw = _joined(raw, source)
        value = _convert(_kind(hints[f.name]), raw, source)
        choices = f.metadata["choices"]
        if choices and value not in choices:
            raise SettingsError(f"{source} must be one of {', '.join(choices)}, got {value!r}")
        values[f.name] = value
    for name in ("admin_token", "reader_token"):
        if values.get(f"{name}_file"):
            values[name] = _read_token_file(values, name)
        elif args is not None and getattr(args, name, None):
            # Taken, but said: every local user sees a process's command line (ps, /proc).
            log.warning(
                "%s was given on the command line, where every user of this machine can read "
                "it (ps); give it in %s or a file (%s) instead",
                _flag(name),
                _env(name),
                _flag(f"{name}_file"),
            )
    settings = Settings(**values)
    _check(settings)
    return settings


def _read_token_file(values: Mapping[str, Any], name: str) -> str:
    """The token in the file `values` names for the setting `name` (``admin_token``, ...)."""
    path = values[f"{name}_file"]
    where = f"{_flag(f'{name}_file')} ({_env(f'{name}_file')})"
    if values.get(name):
        raise SettingsError(f"{where} and {_flag(name)} are both set: give one, not both")
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError(f"{where}: cannot read {path}: {e}") from e
    if not token:
        raise SettingsError(f"{where}: {path} holds no token on its first line")
    return token
