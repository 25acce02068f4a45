"""The bundled fake vLLM, under its first documented import path.

It lives in `capture_proxy.testing.fake_vllm`; this module keeps
``python -m capture_proxy.fake_vllm`` and ``from capture_proxy.fake_vllm import FakeVLLM`` working.
"""

from __future__ import annotations

from .testing.fake_vllm import FakeVLLM, Fault, ToolCall, Turn, main, serve_fake

__all__ = ["FakeVLLM", "Fault", "ToolCall", "Turn", "main", "serve_fake"]

if __name__ == "__main__":
    main()
