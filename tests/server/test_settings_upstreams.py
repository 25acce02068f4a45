"""`--upstream` is a list setting: the flag repeated, comma-separated in the environment, an
array in TOML; `fake` only alone."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from capture_proxy.server.settings import SettingsError, add_arguments, load_settings

A, B = "http://vllm-0:8000", "http://vllm-1:8000"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_repeated_flag_keeps_every_upstream() -> None:
    s = load_settings(_args("--upstream", A, "--upstream", B), {})
    assert s.upstreams == (A, B)


def test_the_environment_takes_a_comma_separated_list() -> None:
    s = load_settings(_args(), {"CAPTURE_PROXY_UPSTREAM": f"{A}, {B}"})
    assert s.upstreams == (A, B)


def test_toml_takes_an_array(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(f'upstream = ["{A}", "{B}"]\n')
    assert load_settings(_args("--config", str(config)), {}).upstreams == (A, B)
    config.write_text(f'upstream = "{A}"\n')  # one URL as a plain string still works
    assert load_settings(_args("--config", str(config)), {}).upstreams == (A,)


def test_one_upstream_is_as_before() -> None:
    assert load_settings(_args("--upstream", A), {}).upstream == A
    assert load_settings(_args(), {}).upstreams == ("fake",)


@pytest.mark.parametrize(
    ("argv", "env", "toml", "message"),
    [
        (("--upstream", "fake", "--upstream", A), {}, None, "'fake' serves alone"),
        ((), {"CAPTURE_PROXY_UPSTREAM": f"fake,{A}"}, None, "'fake' serves alone"),
        (("--upstream", A, "--upstream", A + "/v1"), {}, None, "twice"),
        ((), {"CAPTURE_PROXY_UPSTREAM": f"{A},,{B}"}, None, "must be an http(s) URL"),
        (("--upstream", A, "--upstream", "vllm-1:8000"), {}, None, "'vllm-1:8000'"),
        ((), {}, f'upstream = ["{A}", 8000]', "must be a list of strings"),
    ],
)
def test_invalid_upstream_lists_name_the_setting(
    tmp_path: Path, argv: tuple[str, ...], env: dict[str, str], toml: str | None, message: str
) -> None:
    if toml is not None:
        config = tmp_path / "proxy.toml"
        config.write_text(toml + "\n")
        argv = ("--config", str(config))
    with pytest.raises(SettingsError) as e:
        load_settings(_args(*argv), env)
    assert message in str(e.value)
    assert "upstream" in str(e.value)
