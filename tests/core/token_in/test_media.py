"""`bridged_features`: generate's ``features`` for a bridged prompt, from the request's own
render, or the reason they cannot be put together (the call then goes plain)."""

from __future__ import annotations

from typing import Any

from capture_proxy.core.token_in import MediaItem, bridged_features, media_items


def rendered(*items: tuple[str, str, int, int]) -> dict[str, Any]:
    """A render's ``features`` for (modality, hash, offset, length) items."""
    hashes: dict[str, list[str]] = {}
    ranges: dict[str, list[dict[str, int]]] = {}
    data: dict[str, list[str]] = {}
    for modality, digest, offset, length in items:
        hashes.setdefault(modality, []).append(digest)
        ranges.setdefault(modality, []).append({"offset": offset, "length": length})
        data.setdefault(modality, []).append(f"tensors-of-{digest}")
    return {
        "mm_hashes": hashes,
        "mm_placeholders": ranges,
        "kwargs_data": data,
        "mm_metadata": None,
    }


def test_the_renders_items_are_placed_where_the_bridge_put_them() -> None:
    media = (
        MediaItem("image", "a", 40, 4),
        MediaItem("audio", "s", 60, 2),
        MediaItem("image", "b", 90, 4),
    )
    plain = rendered(("image", "a", 30, 4), ("audio", "s", 45, 2), ("image", "b", 70, 4))
    features, why = bridged_features(media, plain)
    assert why is None
    assert features == {
        **plain,
        "mm_placeholders": {
            "image": [{"offset": 40, "length": 4}, {"offset": 90, "length": 4}],
            "audio": [{"offset": 60, "length": 2}],
        },
    }
    assert media_items(plain)[0] == MediaItem("image", "a", 30, 4)


def test_text_only_needs_no_features() -> None:
    assert bridged_features((), None) == (None, None)


def test_items_that_differ_from_the_renders_are_refused() -> None:
    media = (MediaItem("image", "a", 40, 4), MediaItem("image", "b", 90, 4))
    swapped = rendered(("image", "b", 30, 4), ("image", "a", 70, 4))
    assert bridged_features(media, swapped) == (
        None,
        "the `image` items (2) are not the request's render's (2) in the same order and sizes",
    )
    resized = rendered(("image", "a", 30, 4), ("image", "b", 70, 5))
    assert bridged_features(media, resized)[1] is not None
    assert bridged_features(media, None) == (None, "the request's render has no images")
    assert bridged_features((), rendered(("image", "a", 3, 1)))[1] == (
        "the `image` items (0) are not the request's render's (1) in the same order and sizes"
    )
    assert bridged_features(media, {"mm_hashes": {}}) == (
        None,
        "the request's render: `features` has no mm_hashes or mm_placeholders",
    )
