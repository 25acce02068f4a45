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


#: What each layer (a folder of `capture_proxy`) may import of the others. Modules at the package
#: root (`library`, ...) are the top of the stack and are not listed, except `errors`: it
#: holds `CaptureProxyError`, the root every layer's errors derive from, so every layer may import
#: it and it imports nothing of ours (`test_errors_import_nothing_of_ours`).
LAYERS: dict[str, set[str]] = {
    "schemas": {"errors"},
    "adapters": {"schemas", "errors"},
    "sinks": {"schemas", "errors"},
    "core": {"schemas", "adapters", "sinks", "errors"},
    "upstream": {"schemas", "adapters", "core", "errors"},
    "read": {"schemas", "sinks", "errors"},
    "inspect": {"schemas", "sinks", "read", "errors"},
    "testing": {"errors"},
    # `read`: the batch routes run the trainer side's batch rules (`read.batch_queue`) on the
    # proxy's store, with the reader's own verified reads.
    "server": {
        "schemas",
        "adapters",
        "sinks",
        "core",
        "upstream",
        "testing",
        "read",
        "errors",
        "logs",
    },
    # The `capture-proxy` command: the top of the stack, but without aiohttp of its own (`serve`
    # reaches it through `server`, imported when it runs); `__version__` for `--version`.
    "cli": {
        "schemas",
        "sinks",
        "core",
        "server",
        "read",
        "inspect",
        "errors",
        "logs",
        "__version__",
    },
}
#: Only these may import aiohttp (the HTTP server, the upstream client, the fake vLLM).
AIOHTTP_LAYERS = {"server", "upstream", "testing"}


def _module_name(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports_of(path: Path) -> set[str]:
    """The top-level names imported from `capture_proxy` (and "aiohttp") by one module."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [a.name for a in node.names] if len(target) == 1 else []
            else:
                target = (node.module or "").split(".")
                names = []
            if target[0] == "aiohttp":
                found.add("aiohttp")
            elif target[0] == "capture_proxy":
                found.update([target[1]] if len(target) > 1 else names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")
                if top[0] == "aiohttp":
                    found.add("aiohttp")
                elif top[0] == "capture_proxy" and len(top) > 1:
                    found.add(top[1])
    return found


def test_layers_import_only_the_layers_below_them() -> None:
    layers = {p.name for p in (ROOT / "capture_proxy").iterdir() if (p / "__init__.py").exists()}
    assert layers == set(LAYERS), "a new folder needs its rule here"
    for layer, allowed in LAYERS.items():
        for path in (ROOT / "capture_proxy" / layer).rglob("*.py"):
            used = _imports_of(path) - {layer}
            if layer in AIOHTTP_LAYERS:
                used.discard("aiohttp")
            assert used <= allowed, f"{path.relative_to(ROOT)} imports {sorted(used - allowed)}"


def test_errors_import_nothing_of_ours() -> None:
    # Every layer may import `errors`; were it to import a layer, that layer would be importable
    # from below itself.
    assert _imports_of(ROOT / "capture_proxy" / "errors.py") == set()


def test_no_symlinks_in_the_package() -> None:
    links = [p for p in (ROOT / "capture_proxy").rglob("*") if p.is_symlink()]
    assert links == []


def test_no_filename_prefix_families() -> None:
    # Three or more modules sharing a prefix are a subpackage (docs/architecture.md, "The layers").
    for folder in [ROOT / "capture_proxy", *(ROOT / "capture_proxy").rglob("*/")]:
        stems = [p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")]
        prefixes: dict[str, int] = {}
        for stem in stems:
            if "_" in stem:
                prefixes[stem.split("_")[0]] = prefixes.get(stem.split("_")[0], 0) + 1
        assert all(n < 3 for n in prefixes.values()), (folder, prefixes)


def test_modules_at_the_root_do_not_import_aiohttp() -> None:
    # The library reaches HTTP only through server/ and upstream/ (loaded on use); so does the
    # CLI (cli/, held to it by its layer rule).
    for path in (ROOT / "capture_proxy").glob("*.py"):
        assert "aiohttp" not in _imports_of(path), path.name
