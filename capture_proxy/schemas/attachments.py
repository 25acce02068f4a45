"""How a staged request refers to its attachments.

An image part ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` is
staged as ``{"type": "image_url", "image_url": {"url": "attachment:sha256:<hex>"}}``: the bytes
live once in the store's attachment table, and the digest over the request binds them to the call.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["ATTACHMENT_URL_PREFIX", "attachment_url", "iter_attachment_refs"]

ATTACHMENT_URL_PREFIX = "attachment:sha256:"


def attachment_url(sha256: str) -> str:
    return ATTACHMENT_URL_PREFIX + sha256


def iter_attachment_refs(request: Mapping[str, Any]) -> Iterator[str]:
    """Yield the sha256 of each attachment the request's messages refer to, in order."""
    for message in request.get("messages") or ():
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            for key in ("image_url", "input_audio", "video_url"):
                ref = part.get(key)
                url = ref.get("url") if isinstance(ref, Mapping) else None
                if isinstance(url, str) and url.startswith(ATTACHMENT_URL_PREFIX):
                    yield url[len(ATTACHMENT_URL_PREFIX) :]
