"""A fake vLLM 0.32 that speaks its protocol faithfully, shipped for users' own tests.

``python -m capture_proxy.testing.fake_vllm`` (or ``capture_proxy.fake_vllm``) serves it;
`FakeVLLM` builds the aiohttp app and is scripted with `push` (answers, tool calls, faults), or
from a JSON file of turns (`load_script`, ``--script FILE``).
"""

from __future__ import annotations

import warnings
from typing import Any

from ._app import (
    FakeToolCall,
    FakeVLLM,
    Fault,
    Turn,
    main,
    serve_fake,
)
from ._experts import experts_for, read_experts
from ._script import load_script, parse_script

__all__ = [
    "FakeToolCall",
    "FakeVLLM",
    "Fault",
    "Turn",
    "experts_for",
    "load_script",
    "main",
    "parse_script",
    "read_experts",
    "serve_fake",
]


def deprecated_alias(module: str, name: str) -> Any:
    """The value of a name the fake's modules kept for one release after a rename, with a warning.

    ``ToolCall`` was renamed `FakeToolCall`: the request schema and the vLLM adapter each have a
    tool call class of their own, and one public name should say which it is.
    """
    if name != "ToolCall":
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.ToolCall is deprecated and will be removed in the next release: "
        "use FakeToolCall",
        DeprecationWarning,
        stacklevel=3,
    )
    return FakeToolCall


def __getattr__(name: str) -> Any:
    return deprecated_alias(__name__, name)
