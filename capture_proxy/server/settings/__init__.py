"""Every setting of `capture-proxy serve`, declared once.

Each field of `Settings` is one setting: its name, type, default and help text. The command-line
flag (``--stage-timeout``) and the environment variable (``CAPTURE_PROXY_STAGE_TIMEOUT``) are both
derived from that one declaration, and so is the key in a TOML config file (``--config``) and the
settings page in ``docs/settings.md`` (``capture-proxy settings --markdown``): `--help`, the
environment, the file and the docs cannot disagree.

Precedence: flag > environment > config file > default. Invalid values fail at start with one
sentence that names the setting.

A list setting (``--upstream``) is given by repeating its flag, comma-separated in its
environment variable, or as an array in TOML; its value is kept comma-joined (the environment's
spelling), and `Settings.upstreams` splits it.

The declarations are in `_fields.py`; how values are read (flag, environment, file) in
`_load.py`; the checks a value must pass (ranges, token strength) in `_checks.py`; the flags
and the settings page generated from the declarations in `_help.py`.
"""

from ._checks import token_bits
from ._fields import ENV_PREFIX, GROUPS, Settings, SettingsError
from ._help import add_arguments, settings_markdown
from ._load import load_settings

__all__ = [
    "ENV_PREFIX",
    "GROUPS",
    "Settings",
    "SettingsError",
    "add_arguments",
    "load_settings",
    "settings_markdown",
    "token_bits",
]
