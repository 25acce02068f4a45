"""Helpers shared by the suites and by ``scripts/crash_loop.py`` and ``scripts/soak.py``: a proxy
in front of the fake vLLM in-process (`proxy_harness`), proxy and fake vLLM processes with
agent-like load (`reliability_workers`), sink cases and sessions (`sink_factories`) and the
process that a crash test kills (`crash_worker`)."""

from __future__ import annotations

from pathlib import Path

#: The repository root: docs/, deploy/, scripts/ and tests/fixtures/ are found from here, so a
#: test does not depend on how deep its folder is; child processes that run
#: ``python -m tests.support...`` start here (see tests/__init__.py).
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
