"""Images in a bridged prompt: where vLLM's renders place them, and the ``features`` generate
gets for the whole prompt.

vLLM 0.32's render answers ``features`` for a conversation with images (``MultiModalFeatures``:
per modality, each item's hash in ``mm_hashes``, its placeholder range ``{offset, length}`` in
the rendered ``token_ids`` in ``mm_placeholders``, its processed tensors in ``kwargs_data``,
``mm_metadata``); generate takes them back with the token ids. A bridged prompt is not any
render's ids, so its features are put together (docs/token-in.md, "Images"):

- the previous call's items stay where they were: its prompt is the bridged prompt's start;
- the appended messages' items are where the dummy suffix render puts them, counted from its
  end (`suffix_media`), since the bridged prompt ends with the same tokens;
- the data (``kwargs_data``, ``mm_metadata``) is the request's own render's: it renders every
  image of the conversation, and its items must be the same, in the same order, with the same
  placeholder lengths (`bridged_features`). Anything else is not bridged: never guessed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Defined beside the record's extras, which keep a call's items for the next call after a restart.
from ...schemas.token_in_extras import MediaItem

__all__ = [
    "MediaItem",
    "bridged_features",
    "media_items",
    "media_parts",
    "suffix_media",
]


def media_parts(messages: Iterable[Mapping[str, Any]]) -> int:
    """How many multimodal items `messages` have: content parts other than text."""
    n = 0
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, Mapping) and part.get("type") not in ("text", None):
                n += 1
    return n


def media_items(features: Any) -> tuple[MediaItem, ...]:
    """A render's (or generate request's) ``features`` as items in prompt order; ``()`` for
    null. ValueError when they are not vLLM's shape."""
    if features is None:
        return ()
    if not isinstance(features, Mapping):
        raise ValueError("`features` is not an object")
    hashes, ranges = features.get("mm_hashes"), features.get("mm_placeholders")
    if not isinstance(hashes, Mapping) or not isinstance(ranges, Mapping):
        raise ValueError("`features` has no mm_hashes or mm_placeholders")
    if set(hashes) != set(ranges):
        raise ValueError("`features` has mm_hashes and mm_placeholders of other modalities")
    items = []
    for modality, digests in hashes.items():
        spans = ranges[modality]
        if not isinstance(digests, list) or not isinstance(spans, list):
            raise ValueError(f"`features` has no `{modality}` lists")
        if len(digests) != len(spans):
            raise ValueError(
                f"`features` has {len(digests)} `{modality}` hashes, {len(spans)} ranges"
            )
        for digest, span in zip(digests, spans, strict=True):
            offset = span.get("offset") if isinstance(span, Mapping) else None
            length = span.get("length") if isinstance(span, Mapping) else None
            if not isinstance(digest, str) or type(offset) is not int or type(length) is not int:
                raise ValueError(f"`features` has a malformed `{modality}` item")
            items.append(MediaItem(str(modality), digest, offset, length))
    return tuple(sorted(items, key=lambda item: item.offset))


def suffix_media(features: tuple[Any, Any], length: int) -> tuple[MediaItem, ...]:
    """The items of the two suffix renders (``features`` of each), the first's ids `length`
    long, each offset counted from the end (negative). ValueError when the two differ."""
    first, second = media_items(features[0]), media_items(features[1])
    if first != second:
        raise ValueError("the two suffix renders place their images differently")
    return tuple(MediaItem(m.modality, m.hash, m.offset - length, m.length) for m in first)


def bridged_features(
    media: Sequence[MediaItem], rendered: Any
) -> tuple[dict[str, Any] | None, str | None]:
    """The ``features`` generate gets with a bridged prompt whose items are `media`, from the
    request's own render's (`rendered`): its hashes, data and metadata, placed at `media`'s
    offsets. ``(None, None)`` when neither has items; ``(None, why)`` when they disagree."""
    try:
        plain = media_items(rendered)
    except ValueError as e:
        return None, f"the request's render: {e}"
    if not media and not plain:
        return None, None
    if not plain:
        return None, "the request's render has no images"
    hashes, ranges = rendered["mm_hashes"], rendered["mm_placeholders"]
    for modality in {m.modality for m in media} | set(hashes):
        ours = [(m.hash, m.length) for m in media if m.modality == modality]
        # In the render's own order: the data lists are parallel to it.
        theirs = [
            (digest, span["length"])
            for digest, span in zip(hashes.get(modality, ()), ranges.get(modality, ()), strict=True)
        ]
        if ours != theirs:
            return None, (
                f"the `{modality}` items ({len(ours)}) are not the request's render's "
                f"({len(theirs)}) in the same order and sizes"
            )
    placeholders = {
        modality: [
            {"offset": m.offset, "length": m.length} for m in media if m.modality == modality
        ]
        for modality in hashes
    }
    return {**rendered, "mm_placeholders": placeholders}, None
