"""The public API: what the docs import is at the package root, listed in a sorted `__all__`;
every error derives from `CaptureProxyError`; public class names are unique; renamed names warn.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import capture_proxy
from capture_proxy import CaptureProxyError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "capture_proxy"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_root_name_resolves_and_the_list_is_sorted() -> None:
    names = [n for n in capture_proxy.__all__ if n != "__version__"]
    assert names == sorted(names)
    assert len(names) == len(set(names))
    for name in names:
        value = getattr(capture_proxy, name)
        assert value is not None
        if isinstance(value, type):
            assert value.__name__ == name, f"capture_proxy.{name} is {value.__qualname__}"


def _root_imports_in_docs() -> dict[str, set[str]]:
    """Name -> the documents that tell users ``from capture_proxy import <name>``."""
    found: dict[str, set[str]] = {}
    statement = re.compile(r"from capture_proxy import (\([^)]*\)|[^\n`]*)")
    for doc in DOCS:
        for match in statement.finditer(doc.read_text()):
            for name in re.split(r"[\s,()]+", match.group(1).split(";")[0]):
                if name.isidentifier():
                    found.setdefault(name, set()).add(doc.name)
    return found


def test_what_the_docs_import_from_the_root_is_listed() -> None:
    documented = _root_imports_in_docs()
    assert "open_store" in documented  # the parser still finds the README's import
    missing = {n: sorted(d) for n, d in documented.items() if n not in capture_proxy.__all__}
    assert missing == {}


def test_docs_import_only_modules_that_exist() -> None:
    # ``from capture_proxy.x import y`` in a doc must keep working after the code moves.
    statement = re.compile(r"^\s*from (capture_proxy[\w.]*) import ([\w, ]+)$", re.MULTILINE)
    for doc in DOCS:
        for module, names in statement.findall(doc.read_text()):
            imported = importlib.import_module(module)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(imported, name), f"{doc.name}: from {module} import {name}"


def _packages_with_all() -> list[str]:
    found = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if "__all__" in init.read_text():
            parts = init.relative_to(ROOT).parent.parts
            found.append(".".join(parts))
    return found


@pytest.mark.parametrize("package", _packages_with_all())
def test_each_subpackage_exports_only_names_that_exist(package: str) -> None:
    module = importlib.import_module(package)
    assert len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.__all__ lists {name}, which does not exist"


def test_the_root_and_its_lazy_exports_stay_light() -> None:
    # Resolving every root name imports the server stack; listing them must not.
    code = (
        "import sys, capture_proxy; dir(capture_proxy); "
        "from capture_proxy import CaptureProxyError, RequestValidationError, StoreError; "
        "print(sorted(m for m in ('aiohttp', 'pyarrow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


#: The project's errors, from every layer. Each derives from `CaptureProxyError`, so one
#: ``except`` catches whatever capture-proxy raises on purpose.
ERRORS = [
    "capture_proxy.errors:ProxyError",
    "capture_proxy.errors:CaptureUnavailable",
    "capture_proxy.errors:UpstreamFailed",
    "capture_proxy.sinks.base:StoreError",
    "capture_proxy.sinks.base:StoreFormatError",
    "capture_proxy.sinks.base:StoreDamaged",
    "capture_proxy.schemas.request:RequestValidationError",
    "capture_proxy.schemas.records:RecordValidationError",
    "capture_proxy.schemas.digest:EncodingError",
    "capture_proxy.schemas.digest:DigestMismatch",
    "capture_proxy.adapters.sse:SSEError",
    "capture_proxy.adapters.vllm:UpstreamProtocolError",
    "capture_proxy.adapters.vllm:CaptureExtractionError",
    "capture_proxy.core.policy:PolicyError",
    "capture_proxy.server.settings:SettingsError",
    "capture_proxy.read.reader:StoreCorrupted",
    "capture_proxy.read.integrity:RolloutUnverified",
    "capture_proxy.read.anchors:AnchorsInvalid",
    "capture_proxy.read.experts:ExpertsUnavailable",
    "capture_proxy.read.experts:ExpertsIncomplete",
    "capture_proxy.schemas.experts:ExpertsFormatError",
    "capture_proxy.inspect.views:InspectError",
]


@pytest.mark.parametrize("where", ERRORS)
def test_every_error_derives_from_the_root_exception(where: str) -> None:
    module, name = where.split(":")
    error = getattr(importlib.import_module(module), name)
    assert issubclass(error, CaptureProxyError)


def test_no_error_class_is_left_out_of_the_root() -> None:
    # A new public error class anywhere in the package must derive from CaptureProxyError. The
    # fake vLLM's RequestError stands for vLLM's own 400, not for an error of ours.
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                builtin = bases & {"Exception", "ValueError", "RuntimeError"}
                ours = "CaptureProxyError" in bases or node.name == "CaptureProxyError"
                if builtin and not ours:
                    found.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert found == ["capture_proxy/testing/fake_vllm/_validate.py:RequestError"]


def test_public_class_names_are_unique() -> None:
    defined: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                defined.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in defined.items() if len(p) > 1} == {}


@pytest.mark.parametrize(
    "module", ["capture_proxy", "capture_proxy.fake_vllm", "capture_proxy.testing.fake_vllm"]
)
def test_the_fakes_old_tool_call_name_still_works_with_a_warning(module: str) -> None:
    imported = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match="use .*FakeToolCall"):
        old = imported.ToolCall
    assert old is capture_proxy.FakeToolCall
    assert "ToolCall" not in imported.__all__


def test_an_unknown_root_name_is_an_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'Ledger'"):
            _ = capture_proxy.Ledger
