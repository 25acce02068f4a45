"""The fake vLLM's multimodal ``features``: what render answers for a conversation with images,
and what generate checks of them, sans-IO.

vLLM 0.32's render answers a ``GenerateRequest`` whose ``features`` (``MultiModalFeatures``) are
null for a text-only prompt and otherwise ``{mm_hashes, mm_placeholders, kwargs_data,
mm_metadata}``: per modality, each item's hash, its placeholder range ``{offset, length}`` in
``token_ids``, and its processed tensors (base64; render skips the processor cache, so every
item's are there). Generate takes them back with the token ids; items whose data is not given are
looked up in the server's cache by hash. No captured fixture has them (the CPU test model is
text-only): the shapes are vLLM 0.32's code (``scale_out/token_in_token_out``'s
``MultiModalFeatures``, ``extract_mm_features``, and generate's ``serve_tokens``).

The fake's template writes one ``<|image_pad|>`` per image part (a real vision model's
processor writes many); an item's hash is the SHA-256 of its part's JSON, its "tensors" the
base64 of that JSON. Generate refuses, with a 400, features whose lists are not parallel (as vLLM's
``MultiModalFeatures`` does), and, stricter than vLLM, features whose ranges do not cover exactly
the prompt's ``<|image_pad|>`` tokens or whose data does not match its hash: vLLM's engine puts
each item's embeddings at its range whatever tokens are there, and checks data against its hash
only for shared-memory cache handles, so a misplaced image or data sent under another item's hash
would pass silently; the fake's checks let a test see them. An item without data must have been
rendered by this fake before (its cache).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson

from ._template import SPECIAL_TOKENS
from ._validate import RequestError

__all__ = ["IMAGE_PARTS", "check_features", "image_parts", "render_features"]

#: The content part types the fake's template renders as an image.
IMAGE_PARTS = ("image_url", "input_image", "image")
_PAD = SPECIAL_TOKENS["<|image_pad|>"]


def image_parts(messages: Sequence[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    """The image parts of `messages`, in the order the template renders them."""
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
                yield part


def _item(part: Mapping[str, Any]) -> tuple[str, str]:
    data = orjson.dumps(part, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(data).hexdigest(), base64.b64encode(data).decode()


def render_features(
    messages: Sequence[Mapping[str, Any]], ids: Sequence[int], cache: dict[str, str]
) -> dict[str, Any] | None:
    """Render's ``features`` for `messages` rendered as `ids` (None without images); each item
    is put in `cache` (hash → data), as vLLM's processor cache keeps what it processed."""
    parts = list(image_parts(messages))
    if not parts:
        return None
    offsets = [i for i, t in enumerate(ids) if t == _PAD]
    if len(offsets) != len(parts):
        raise RequestError(
            400,
            f"Expected there to be {len(parts)} image placeholders in the prompt, "
            f"found {len(offsets)}.",
        )
    items = [_item(p) for p in parts]
    for digest, data in items:
        cache[digest] = data
    return {
        "mm_hashes": {"image": [digest for digest, _ in items]},
        "mm_placeholders": {"image": [{"offset": o, "length": 1} for o in offsets]},
        "kwargs_data": {"image": [data for _, data in items]},
        "mm_metadata": None,
    }


def check_features(features: Any, ids: Sequence[int], cache: Mapping[str, str]) -> None:
    """Generate's checks of a request's ``features`` against its `ids` (module docs)."""
    pads = sum(1 for t in ids if t == _PAD)
    if features is None:
        return
    if not isinstance(features, Mapping):
        raise RequestError(400, "`features` must be an object.", param="features")
    hashes, ranges = features.get("mm_hashes"), features.get("mm_placeholders")
    if not isinstance(hashes, Mapping) or not isinstance(ranges, Mapping):
        raise RequestError(400, "`features` needs mm_hashes and mm_placeholders.")
    if set(hashes) != set(ranges):
        raise RequestError(400, "mm_hashes and mm_placeholders must use the same modalities")
    kwargs = features.get("kwargs_data") or {}
    covered = 0
    for modality, digests in hashes.items():
        spans = ranges[modality]
        data = kwargs.get(modality) or [None] * len(digests)
        if not (len(digests) == len(spans) == len(data)):
            raise RequestError(400, f"the `{modality}` lists of `features` are not parallel")
        for digest, span, item in zip(digests, spans, data, strict=True):
            start, length = span.get("offset"), span.get("length")
            if not (type(start) is int and type(length) is int and length > 0 and start >= 0):
                raise RequestError(400, "a placeholder range needs an offset and a length")
            if any(t != _PAD for t in ids[start : start + length]) or start + length > len(ids):
                raise RequestError(
                    400, f"the placeholder at {start} (length {length}) is not an image's"
                )
            covered += length
            known = cache.get(digest) if item is None else item
            if known is None or _item_hash(known) != digest:
                raise RequestError(400, f"the multimodal item {digest[:12]} does not match")
    if covered != pads:
        raise RequestError(
            400, f"the features place {covered} image tokens, the prompt has {pads} image pads"
        )


def _item_hash(data: str) -> str:
    return hashlib.sha256(base64.b64decode(data)).hexdigest()
