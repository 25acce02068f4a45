"""capture-proxy: stage the exact tokens of every model call an agent makes, or say loudly why not.

Public names are re-exported lazily, so ``from capture_proxy import open_store`` in a trainer does
not import aiohttp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Attachment": "capture_proxy.schemas.records",
    "CallStatus": "capture_proxy.schemas.records",
    "CommitCoords": "capture_proxy.schemas.records",
    "FakeVLLM": "capture_proxy.testing.fake_vllm",
    "Fault": "capture_proxy.testing.fake_vllm",
    "LedgerEntry": "capture_proxy.schemas.records",
    "MemorySink": "capture_proxy.sinks.memory",
    "StageResult": "capture_proxy.schemas.records",
    "StagedCallRecord": "capture_proxy.schemas.records",
    "StagingSink": "capture_proxy.sinks.base",
    "StagingSource": "capture_proxy.sinks.base",
    "ToolCall": "capture_proxy.testing.fake_vllm",
    "Turn": "capture_proxy.testing.fake_vllm",
    "Store": "capture_proxy.read.reader",
    "open_store": "capture_proxy.read.reader",
}

__all__ = [
    "Attachment",
    "CallStatus",
    "CommitCoords",
    "FakeVLLM",
    "Fault",
    "LedgerEntry",
    "MemorySink",
    "StageResult",
    "StagedCallRecord",
    "StagingSink",
    "StagingSource",
    "Store",
    "ToolCall",
    "Turn",
    "__version__",
    "open_store",
]

if TYPE_CHECKING:
    from .read.reader import Store, open_store
    from .schemas.records import (
        Attachment,
        CallStatus,
        CommitCoords,
        LedgerEntry,
        StagedCallRecord,
        StageResult,
    )
    from .sinks.base import StagingSink, StagingSource
    from .sinks.memory import MemorySink
    from .testing.fake_vllm import FakeVLLM, Fault, ToolCall, Turn


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'capture_proxy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
