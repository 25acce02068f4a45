"""The upstream vLLM behind one client: its HTTP calls and the facts fetched about it.

`HTTPUpstream` implements `capture_proxy.core.transport.UpstreamTransport` over aiohttp; the
proxy and `CaptureClient(upstream=URL)` use it. `ReplicaSet` puts several of them (replicas of
one model) behind one transport, each rollout pinned to one.
"""

from ..core.transport import UpstreamInfo
from .facts import PROBE_MESSAGES, fingerprint_of, reasoning_field_for
from .http import HTTPUpstream, HTTPUpstreamReply
from .replicas import Replica, ReplicaSet, replica_name

__all__ = [
    "PROBE_MESSAGES",
    "HTTPUpstream",
    "HTTPUpstreamReply",
    "Replica",
    "ReplicaSet",
    "UpstreamInfo",
    "fingerprint_of",
    "reasoning_field_for",
    "replica_name",
]
