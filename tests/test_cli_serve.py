"""`capture-proxy serve` as users run it: settings precedence, start-up errors, a real process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from capture_proxy.inspect.cli import relative_store_path
from capture_proxy.read.reader import open_store
from capture_proxy.server.settings import Settings, SettingsError, add_arguments, load_settings


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flag_beats_environment_beats_default() -> None:
    env = {"CAPTURE_PROXY_PORT": "9001", "CAPTURE_PROXY_STAGE_TIMEOUT": "2.5"}
    s = load_settings(_args("--port", "9002"), env)
    assert s.port == 9002  # flag
    assert s.stage_timeout == 2.5  # environment
    assert s.store == Settings().store  # default


def test_boolean_settings_from_flag_and_environment() -> None:
    assert load_settings(_args("--allow-remote-media"), {}).allow_remote_media is True
    env = {"CAPTURE_PROXY_ALLOW_REMOTE_MEDIA": "yes"}
    assert load_settings(_args(), env).allow_remote_media is True
    assert load_settings(_args("--no-allow-remote-media"), env).allow_remote_media is False


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (("--port", "x"), {}, "--port"),
        ((), {"CAPTURE_PROXY_PORT": "70000"}, "--port (CAPTURE_PROXY_PORT)"),
        ((), {"CAPTURE_PROXY_REQUIRE_ROLLOUT_ID": "maybe"}, "CAPTURE_PROXY_REQUIRE_ROLLOUT_ID"),
        (("--stage-timeout", "0"), {}, "--stage-timeout"),
        (("--upstream", "ftp://x"), {}, "--upstream"),
        ((), {"CAPTURE_PROXY_ON_CAPTURE_FAILURE": "ignore"}, "CAPTURE_PROXY_ON_CAPTURE_FAILURE"),
        (("--require-rollout-keys",), {}, "--admin-token"),
    ],
)
def test_invalid_settings_name_the_setting(
    argv: tuple[str, ...], env: dict[str, str], names: str
) -> None:
    with pytest.raises(SettingsError) as e:
        load_settings(_args(*argv), env)
    assert names in str(e.value)


def test_secrets_are_masked_in_public_settings() -> None:
    s = load_settings(
        _args("--upstream-api-key", "sk-1", "--admin-token", "cli-admin-token-0123456789"), {}
    )
    shown = s.public()
    assert shown["upstream_api_key"] == "***"
    assert shown["admin_token"] == "***"


def _post(url: str, body: dict[str, object]) -> tuple[dict[str, str], dict[str, object]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(resp.headers), json.loads(resp.read())


def _until_trimmed(url: str) -> float:
    """``capture_proxy_heap_trims_total`` from /metrics once it is at least 1 (at most ~5 s)."""
    trims = 0.0
    for _ in range(100):
        with urllib.request.urlopen(url, timeout=10) as resp:
            scrape = resp.read().decode()
        assert "capture_proxy_heap_trim_max_seconds" in scrape
        found = re.search(r"^capture_proxy_heap_trims_total ([0-9.e+]+)$", scrape, re.MULTILINE)
        assert found, scrape
        trims = float(found.group(1))
        if trims >= 1 or platform.libc_ver()[0] != "glibc":
            break
        time.sleep(0.05)
    return trims


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_serve_fake_stages_calls_and_stops_on_sigterm(tmp_path: Path, loop: str) -> None:
    env = {
        **os.environ,
        "CAPTURE_PROXY_MIN_FREE_DISK_MB": "0",
        "CAPTURE_PROXY_LOOP": loop,
        "CAPTURE_PROXY_MALLOC_TRIM_INTERVAL": "0.05",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capture_proxy",
            "serve",
            "--upstream",
            "fake",
            "--store",
            "sqlite:///capture.db",
            "--port",
            "0",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        seen = []
        match = None
        # Read up to the banner's event-loop line here: communicate() below reads the pipe's
        # descriptor and would miss what readline() already buffered.
        for _ in range(20):  # log lines may come first
            seen.append(proc.stdout.readline())
            match = match or re.search(r"listening on (http://127\.0\.0\.1:\d+)", seen[-1])
            if "event loop:" in seen[-1]:
                break
        assert match, seen
        assert f"event loop: {loop}" in "".join(seen)
        # --transparent-huge-pages defaults to off: the kernel reports it for the process.
        assert "THP_enabled:\t0" in Path(f"/proc/{proc.pid}/status").read_text()
        base = match.group(1)
        headers, body = _post(
            f"{base}/r/demo/v1/chat/completions",
            {"model": "policy", "messages": [{"role": "user", "content": "hello"}]},
        )
        assert headers["X-Capture-Status"] == "staged"
        assert body["choices"][0]["message"]["content"]  # type: ignore[index]
        # The heap trim's loop runs beside the server, and /metrics says how often and how long.
        trims = _until_trimmed(f"{base}/metrics")
        assert trims >= 1 if platform.libc_ver()[0] == "glibc" else trims == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    with open_store(f"sqlite:///{tmp_path / 'capture.db'}") as store:
        (record,) = store.calls("demo", include_open=True, include_poisoned=True)
        store.verify()
    assert record.call_id == headers["X-Capture-Call-Id"]


def test_serve_refuses_bad_settings_in_one_sentence(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "capture_proxy", "serve", "--stage-timeout", "-1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "capture-proxy: --stage-timeout (CAPTURE_PROXY_STAGE_TIMEOUT) must be > 0, got -1.0"
    )


def test_config_file_sits_between_environment_and_default(tmp_path: Path) -> None:
    cfg = tmp_path / "proxy.toml"
    cfg.write_text(
        'store = "sqlite:///from-file.db"\nport = 9100\nstage_timeout = 3\n'
        "[policy_defaults]\ntemperature = 0.5\n"
    )
    s = load_settings(
        _args("--config", str(cfg), "--port", "9200"), {"CAPTURE_PROXY_STAGE_TIMEOUT": "4"}
    )
    assert s.port == 9200  # flag beats file
    assert s.stage_timeout == 4.0  # environment beats file
    assert s.store == "sqlite:///from-file.db"  # file beats default
    assert s.policy_defaults == {"temperature": 0.5}
    via_env = load_settings(_args(), {"CAPTURE_PROXY_CONFIG": str(cfg)})
    assert via_env.port == 9100


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stage_timeot = 3\n", "unknown setting 'stage_timeot'"),
        ("port = 'x'\n", "port in "),
        ("port = [\n", "is not valid TOML"),
        ("policy_force = 3\n", "policy_force in "),
    ],
)
def test_bad_config_file_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_settings(_args("--config", str(cfg)), {})


def test_a_store_linger_of_half_the_stage_timeout_or_more_is_refused() -> None:
    assert load_settings(_args("--store-linger", "0.5"), {}).store_linger == 0.5
    with pytest.raises(SettingsError, match=r"--store-linger .* under half of --stage-timeout"):
        load_settings(_args("--store-linger", "2", "--stage-timeout", "4"), {})
    with pytest.raises(SettingsError, match=r"--store-linger .* must be >= 0"):
        load_settings(_args(), {"CAPTURE_PROXY_STORE_LINGER": "-1"})


def test_missing_config_file() -> None:
    with pytest.raises(SettingsError, match="no such file"):
        load_settings(_args("--config", "/nonexistent/proxy.toml"), {})


def test_json_settings_from_flag() -> None:
    s = load_settings(_args("--policy-force", '{"seed": 3}'), {})
    assert s.policy_force == {"seed": 3}
    with pytest.raises(SettingsError, match="--policy-force must be a JSON object"):
        load_settings(_args("--policy-force", "{seed"), {})


def test_settings_page_is_generated_from_the_declarations() -> None:
    from capture_proxy.server.settings import settings_markdown

    page = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
    assert page.read_text() == settings_markdown(), (
        "run: capture-proxy settings --markdown > docs/settings.md"
    )
    for f in dataclasses.fields(Settings):
        assert f"`--{f.name.replace('_', '-')}`" in page.read_text()


def test_help_lists_every_setting() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "capture_proxy", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for f in dataclasses.fields(Settings):
        assert f"--{f.name.replace('_', '-')}" in out


def test_serve_says_a_three_slash_store_is_relative_and_warns_when_only_absolute_exists(
    tmp_path: Path,
) -> None:
    """``parquet:///srv/data`` is ./srv/data (SQLAlchemy's convention): the start-up line says
    so, and a warning names the URL to write when /srv/data is what exists."""
    meant = tmp_path / "data"
    meant.mkdir()
    run_in = tmp_path / "run"
    run_in.mkdir()
    relative = str(meant).lstrip("/")
    store = f"parquet:///{relative}"
    env = {**os.environ, "CAPTURE_PROXY_MIN_FREE_DISK_MB": "0"}
    argv = ["serve", "--store", store, "--port", "0", "--log-format", "text"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "capture_proxy", *argv],
        cwd=run_in,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        for _ in range(30):  # up to the banner
            seen.append(proc.stderr.readline())
            if "listening on" in seen[-1]:
                break
        text = "".join(seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert "listening on" in text, text
    assert (
        f"capture-proxy store {store} is {run_in / relative}: three slashes take a path relative "
        f"to the working folder, four an absolute one (parquet:////{relative})\n"
    ) in text
    (warning,) = [line for line in seen if " WARNING " in line and store in line]
    assert f"/{relative} does: for it write parquet:////{relative}" in warning
    # Only the three-slash form is relative by convention; the others say what they say.
    assert relative_store_path(store) == relative
    for url in (f"parquet:////{relative}", str(meant), "s3://bucket/x", "memory://m"):
        assert relative_store_path(url) is None, url
    assert relative_store_path("sqlite:///capture.db") == "capture.db"
