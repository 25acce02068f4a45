"""Upstream dialects: one module per upstream server family (vLLM today)."""
