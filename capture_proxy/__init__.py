"""capture-proxy: stage the exact tokens of every model call an agent makes, or say loudly why not.

Everything the documentation tells you to import is importable from here::

    from capture_proxy import open_store, CaptureClient, open_sink, RequestPolicy

The names are re-exported lazily: ``from capture_proxy import open_store`` in a trainer imports
the reader and the records, not aiohttp or pyarrow. Every error capture-proxy raises on purpose
derives from `CaptureProxyError`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it (imported on first use).
_EXPORTS = {
    "Attachment": "capture_proxy.schemas.records",
    "CallStatus": "capture_proxy.schemas.records",
    "CaptureClient": "capture_proxy.library",
    "CaptureExtractionError": "capture_proxy.adapters.vllm",
    "CaptureProxyError": "capture_proxy.errors",
    "CommitCoords": "capture_proxy.schemas.records",
    "DigestMismatch": "capture_proxy.schemas.digest",
    "Drift": "capture_proxy.read.trajectory",
    "EncodingError": "capture_proxy.schemas.digest",
    "ExportCursor": "capture_proxy.read.cursor",
    "ExpertsIncomplete": "capture_proxy.read.experts",
    "ExpertsUnavailable": "capture_proxy.read.experts",
    "FakeToolCall": "capture_proxy.testing.fake_vllm",
    "FakeVLLM": "capture_proxy.testing.fake_vllm",
    "Fault": "capture_proxy.testing.fake_vllm",
    "LedgerEntry": "capture_proxy.schemas.records",
    "MemorySink": "capture_proxy.sinks.memory",
    "PolicyError": "capture_proxy.core.policy",
    "PreparedCall": "capture_proxy.library",
    "ChatResult": "capture_proxy.library",
    "ProxyError": "capture_proxy.errors",
    "RecordValidationError": "capture_proxy.schemas.records",
    "RequestPolicy": "capture_proxy.core.policy",
    "RequestValidationError": "capture_proxy.schemas.request",
    "NotStaged": "capture_proxy.read.status",
    "RolloutExcluded": "capture_proxy.read.status",
    "RolloutUnverified": "capture_proxy.read.integrity",
    "RolloutInfo": "capture_proxy.schemas.records",
    "RolloutState": "capture_proxy.schemas.records",
    "Segment": "capture_proxy.read.trajectory",
    "StageResult": "capture_proxy.schemas.records",
    "StagedCallRecord": "capture_proxy.schemas.records",
    "StagingSink": "capture_proxy.sinks.base",
    "StagingSource": "capture_proxy.sinks.base",
    "Store": "capture_proxy.read.reader",
    "StoreAccessDenied": "capture_proxy.sinks.remote",
    "StoreCorrupted": "capture_proxy.read.reader",
    "StoreDamaged": "capture_proxy.sinks.base",
    "StoreError": "capture_proxy.sinks.base",
    "StoreFormatError": "capture_proxy.sinks.base",
    "Trajectory": "capture_proxy.read.trajectory",
    "Turn": "capture_proxy.testing.fake_vllm",
    "HTTPUpstream": "capture_proxy.upstream.http",
    "UpstreamInfo": "capture_proxy.core.transport",
    "UpstreamTransport": "capture_proxy.core.transport",
    "UpstreamProtocolError": "capture_proxy.adapters.vllm",
    "open_sink": "capture_proxy.sinks.registry",
    "open_source": "capture_proxy.sinks.registry",
    "open_store": "capture_proxy.read.reader",
}

#: Renamed public names -> their new names: each old one still resolves for one release, with a
#: DeprecationWarning. (`ToolCall` was the fake vLLM's; the request schema has one too.)
_DEPRECATED = {"ToolCall": "FakeToolCall"}

__all__ = [
    "Attachment",
    "CallStatus",
    "CaptureClient",
    "CaptureExtractionError",
    "CaptureProxyError",
    "ChatResult",
    "CommitCoords",
    "DigestMismatch",
    "Drift",
    "EncodingError",
    "ExpertsIncomplete",
    "ExpertsUnavailable",
    "ExportCursor",
    "FakeToolCall",
    "FakeVLLM",
    "Fault",
    "HTTPUpstream",
    "LedgerEntry",
    "MemorySink",
    "NotStaged",
    "PolicyError",
    "PreparedCall",
    "ProxyError",
    "RecordValidationError",
    "RequestPolicy",
    "RequestValidationError",
    "RolloutExcluded",
    "RolloutInfo",
    "RolloutState",
    "RolloutUnverified",
    "Segment",
    "StageResult",
    "StagedCallRecord",
    "StagingSink",
    "StagingSource",
    "Store",
    "StoreAccessDenied",
    "StoreCorrupted",
    "StoreDamaged",
    "StoreError",
    "StoreFormatError",
    "Trajectory",
    "Turn",
    "UpstreamInfo",
    "UpstreamProtocolError",
    "UpstreamTransport",
    "__version__",
    "open_sink",
    "open_source",
    "open_store",
]

if TYPE_CHECKING:
    from .adapters.vllm import CaptureExtractionError, UpstreamProtocolError
    from .core.policy import PolicyError, RequestPolicy
    from .core.transport import UpstreamInfo, UpstreamTransport
    from .errors import CaptureProxyError, ProxyError
    from .library import CaptureClient, ChatResult, PreparedCall
    from .read.cursor import ExportCursor
    from .read.experts import ExpertsIncomplete, ExpertsUnavailable
    from .read.integrity import RolloutUnverified
    from .read.reader import Store, StoreCorrupted, open_store
    from .read.status import NotStaged, RolloutExcluded
    from .read.trajectory import Drift, Segment, Trajectory
    from .schemas.digest import DigestMismatch, EncodingError
    from .schemas.records import (
        Attachment,
        CallStatus,
        CommitCoords,
        LedgerEntry,
        RecordValidationError,
        RolloutInfo,
        RolloutState,
        StagedCallRecord,
        StageResult,
    )
    from .schemas.request import RequestValidationError
    from .sinks.base import StagingSink, StagingSource, StoreDamaged, StoreError, StoreFormatError
    from .sinks.memory import MemorySink
    from .sinks.registry import open_sink, open_source
    from .testing.fake_vllm import FakeToolCall, FakeVLLM, Fault, Turn
    from .upstream.http import HTTPUpstream


def __getattr__(name: str) -> Any:
    new = _DEPRECATED.get(name)
    if new is not None:
        warnings.warn(
            f"capture_proxy.{name} is deprecated and will be removed in the next release: "
            f"use capture_proxy.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_EXPORTS[new]), new)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'capture_proxy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
