"""The upstream vLLM behind one client: its HTTP calls and the facts fetched about it.

`HTTPUpstream` implements `capture_proxy.core.transport.UpstreamTransport` over aiohttp; the
proxy and `CaptureClient(upstream=URL)` use it.
"""

from ..core.transport import UpstreamInfo
from .facts import PROBE_MESSAGES, fingerprint_of, reasoning_field_for
from .http import HTTPUpstream, HTTPUpstreamReply

__all__ = [
    "PROBE_MESSAGES",
    "HTTPUpstream",
    "HTTPUpstreamReply",
    "UpstreamInfo",
    "fingerprint_of",
    "reasoning_field_for",
]
