"""A fake vLLM 0.32 that speaks its protocol faithfully, shipped for users' own tests.

``python -m capture_proxy.testing.fake_vllm`` (or ``capture_proxy.fake_vllm``) serves it;
`FakeVLLM` builds the aiohttp app and is scripted with `push` (answers, tool calls, faults).
"""

from __future__ import annotations

from ._app import (
    FakeVLLM,
    Fault,
    ToolCall,
    Turn,
    main,
    serve_fake,
)

__all__ = [
    "FakeVLLM",
    "Fault",
    "ToolCall",
    "Turn",
    "main",
    "serve_fake",
]
