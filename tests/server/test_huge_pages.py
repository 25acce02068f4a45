"""``--transparent-huge-pages``: what the serving process asks of the kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest

from capture_proxy.server import huge_pages
from capture_proxy.server.settings import Settings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def _in_child(code: str) -> str:
    """Run `code` in a fresh interpreter: the THP flag is per process and inherited."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip()


def test_off_turns_huge_pages_off_for_the_process_and_its_status_says_so() -> None:
    out = _in_child(
        "from capture_proxy.server import huge_pages as h\n"
        "before = h.thp_disabled()\n"
        "h.apply('off')\n"
        "status = open('/proc/self/status').read()\n"
        "print(before, h.thp_disabled(), 'THP_enabled:\\t0' in status)\n"
    )
    assert out == "False True True"


def test_system_leaves_the_machine_policy() -> None:
    out = _in_child(
        "from capture_proxy.server import huge_pages as h\n"
        "h.apply('system')\n"
        "print(h.thp_disabled())\n"
    )
    assert out == "False"


def test_the_default_is_off_and_a_bad_choice_is_named() -> None:
    assert Settings().transparent_huge_pages == "off"
    with pytest.raises(ValueError, match="--transparent-huge-pages must be one of off, system"):
        huge_pages.apply("never")
