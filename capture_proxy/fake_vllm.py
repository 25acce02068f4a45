"""The bundled fake vLLM, under its first documented import path.

It lives in `capture_proxy.testing.fake_vllm`; this module keeps
``python -m capture_proxy.fake_vllm`` and ``from capture_proxy.fake_vllm import FakeVLLM`` working.
"""

from __future__ import annotations

from typing import Any

from .testing.fake_vllm import (
    FakeToolCall,
    FakeVLLM,
    Fault,
    Turn,
    deprecated_alias,
    main,
    serve_fake,
)

__all__ = ["FakeToolCall", "FakeVLLM", "Fault", "Turn", "main", "serve_fake"]


def __getattr__(name: str) -> Any:
    # ``ToolCall``, renamed `FakeToolCall`, still resolves for one release, with a warning.
    return deprecated_alias(__name__, name)


if __name__ == "__main__":
    main()
