"""`capture-proxy --version`, and `--help` of every subcommand shows each flag's default."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

import capture_proxy
from capture_proxy.cli import _parser, main
from capture_proxy.server.settings import GROUPS, Settings


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help lines `parser` prints for one flag, whitespace collapsed (help wraps)."""
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def test_version_prints_the_package_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "capture_proxy", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == f"capture-proxy {capture_proxy.__version__}\n"


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_flag_with_a_default_shows_it_in_help(command: str) -> None:
    parser = _subcommands()[command]
    missing = []
    for action in parser._actions:
        takes_value = action.nargs != 0 and (action.option_strings or action.nargs == "?")
        if not takes_value or action.default in (None, argparse.SUPPRESS):
            continue
        if f"(default: {action.default})" not in _help_of(parser, action):
            missing.append(action.option_strings or action.dest)
    assert not missing, f"capture-proxy {command} --help shows no default for {missing}"


def test_serve_help_shows_every_settings_default() -> None:
    """serve's flags default to None (so the environment can fill them): their help names the
    setting's real default instead."""
    parser = _subcommands()["serve"]
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for name in Settings.__dataclass_fields__:
        text = _help_of(parser, by_flag["--" + name.replace("_", "-")])
        assert "default: " in text, text


def test_switches_show_no_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: call)" in text  # --per shows its default beside its help
    assert "(default: False)" not in text
    assert "(default: True)" not in text  # --no-verify: a switch, not a value


def test_inspect_help_names_every_store_form_it_reads() -> None:
    parser = _subcommands()["inspect"]
    (store,) = [a for a in parser._actions if a.dest == "store"]
    text = _help_of(parser, store)
    for form in ("sqlite:///", "parquet:///", "s3://", "http://HOST:PORT", "https://", "a path"):
        assert form in text, (form, text)


def test_serve_help_groups_the_settings_and_shows_fixed_values() -> None:
    text = subprocess.run(
        [sys.executable, "-m", "capture_proxy", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert text.startswith("usage: capture-proxy serve [--config FILE] [OPTION ...]\n")
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and line[:1] != " "]
    assert headings == ["options", *GROUPS]
    for title in ("upstream", "store", "sandboxes", "control API", "token-in", "limits"):
        assert title in GROUPS
    # Each group lists its own flags, under its heading, in the declared order.
    blocks = re.split(r"^(\S[^\n]*):$", text, flags=re.MULTILINE)
    by_title = dict(zip(blocks[1::2], blocks[2::2], strict=True))
    for title, (_, names) in GROUPS.items():
        flags = re.findall(r"^  (--[a-z-]+)", by_title[title], flags=re.MULTILINE)
        assert flags == ["--" + n.replace("_", "-") for n in names.split()], title
    # A setting with fixed values shows them where the value goes.
    assert "--token-in {off,on}" in text
    assert "--log-format {json,text}" in text
    assert "--upstream-logprobs-mode {raw_logprobs,processed_logprobs,unknown}" in text


def test_every_setting_is_in_exactly_one_help_group() -> None:
    grouped = [name for _, names in GROUPS.values() for name in names.split()]
    assert sorted(grouped) == sorted(Settings.__dataclass_fields__)


def test_store_help_says_three_slashes_are_relative() -> None:
    parser = _subcommands()["serve"]
    (store,) = [a for a in parser._actions if a.dest == "store"]
    text = _help_of(parser, store)
    assert "Three slashes take a path relative to the working folder" in text
    assert "parquet:///data/x is ./data/x" in text
    assert "parquet:////data/x is /data/x" in text
