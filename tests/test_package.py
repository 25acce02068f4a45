"""Package-level promises: light imports for trainers, a sorted public API, the import direction."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import capture_proxy

ROOT = Path(__file__).resolve().parents[1]


def test_reading_a_store_does_not_import_the_server_stack() -> None:
    code = (
        "import sys; from capture_proxy import open_store, StagedCallRecord; "
        "print(sorted(m for m in ('aiohttp', 'pyarrow', 'prometheus_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names_are_sorted_and_resolve() -> None:
    names = [n for n in capture_proxy.__all__ if n != "__version__"]
    assert names == sorted(names)
    for name in names:
        assert getattr(capture_proxy, name) is not None


def _imports(folder: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / folder).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                if node.level >= 2:
                    found.add(node.module.split(".")[0])
                elif node.module.startswith("capture_proxy."):
                    found.add(node.module.split(".")[1])
    return found


def test_imports_run_one_way() -> None:
    # schemas imports none of the others; adapters and sinks only schemas (DESIGN: STYLE.md §2).
    assert _imports("schemas") <= set()
    assert _imports("adapters") <= {"schemas"}
    assert _imports("sinks") <= {"schemas"}
