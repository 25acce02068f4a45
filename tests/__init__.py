"""The test suite: one folder per ``capture_proxy`` subpackage, plus ``reliability/`` (crash, fault,
fuzz, isolation and soak suites) and ``e2e/`` (real OpenCode, real vLLM).

How the code that is not shipped imports itself: the repository root is its import root, and
``tests``, ``tests.support`` and ``scripts`` are packages imported by absolute name
(``from tests.support.proxy_harness import start_proxy``, ``from scripts import tiny_vllm``).
pytest puts the root on ``sys.path`` (``pythonpath = ["."]`` in pyproject.toml); scripts that use
the test support run from the root as modules (``python -m scripts.soak``); child processes the
tests start run ``python -m tests.support.<worker>`` with the root as their working directory.
Nothing edits ``sys.path``. Every folder has an ``__init__.py``, so test modules are named by
their path (``tests.sinks.test_gc``) and two folders may hold files of the same name.
"""
