"""What the proxy learns about its upstream: the reasoning field by version, the tokenizer probe,
the sampling defaults of a probe render."""

from __future__ import annotations

import hashlib
import re
from array import array
from typing import Any

import orjson

from ..core.sampling import RESOLVED_SAMPLING_KEYS

__all__ = [
    "PROBE_MESSAGES",
    "fingerprint_of",
    "reasoning_field_for",
    "sampling_defaults_of",
    "scale_out_served",
]

#: The fixed conversation whose token ids fingerprint the upstream's tokenizer + chat template.
PROBE_MESSAGES = [
    {"role": "system", "content": "capture-proxy tokenizer probe v1"},
    {"role": "user", "content": 'Hello, world! 0123456789 {"k": [1, 2.5]} ü 漢字 🙂\n\tend'},
]


def reasoning_field_for(version: str) -> str:
    """vLLM 0.16–0.21 read replayed reasoning only as `reasoning`; others `reasoning_content`."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m and int(m.group(1)) == 0 and 16 <= int(m.group(2)) <= 21:
        return "reasoning"
    return "reasoning_content"


def fingerprint_of(tokens: Any) -> str:
    """``sha256:<hex>`` of the probe's token ids as int32, or "" when they are not ids."""
    try:
        ids = array("i", tokens)
    except (TypeError, OverflowError):
        return ""
    return "sha256:" + hashlib.sha256(ids.tobytes()).hexdigest()


def sampling_defaults_of(render: Any) -> dict[str, Any] | None:
    """The resolved sampling parameters of a probe render's answer (vLLM's `GenerateRequest`,
    whose ``sampling_params`` hold the model's defaults for a request that set none), or None
    when the answer has none."""
    params = render.get("sampling_params") if isinstance(render, dict) else None
    if not isinstance(params, dict):
        return None
    return {k: params[k] for k in RESOLVED_SAMPLING_KEYS if k in params}


def scale_out_served(status: int, body: bytes) -> bool | None:
    """What a render answer that is not a 200 says of vLLM's scale-out routes: False for the 403
    of a vLLM started without ``--enable-scale-out`` ("Scale-out endpoints are disabled") and
    for a route-level 404 (``{"detail": "Not Found"}``: a vLLM without the routes); None for
    anything else (a 404 naming an unknown model, a 5xx): it says nothing about the routes."""
    if status == 403:
        return False
    if status == 404:
        try:
            detail = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if isinstance(detail, dict) and detail.get("detail") == "Not Found":
            return False
    return None
