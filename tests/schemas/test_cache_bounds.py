"""Every cache of encoded request values is bounded by bytes, not only by count: a huge value
is encoded (to the same digest) but never kept, and many large ones evict each other."""

from __future__ import annotations

from capture_proxy.schemas.digest import (
    MessageDigestCache,
    RequestValueCache,
    encode_value,
    message_digest,
)


def test_a_huge_request_value_is_encoded_but_not_cached() -> None:
    cache = RequestValueCache(max_bytes=1 << 20)
    huge = {"x": list(range(100_000))}
    assert cache(huge, "request.tools") == encode_value(huge, field="request.tools")
    assert len(cache) == 0
    assert cache.bytes == 0


def test_request_values_are_evicted_by_bytes() -> None:
    cache = RequestValueCache(max_entries=1000, max_bytes=400_000)
    for i in range(40):
        cache({"i": i, "x": list(range(5000))}, "request.tools")  # ~74 KB of key + encoding
        assert cache.bytes <= 400_000
    assert 0 < len(cache) < 40
    # The most recent value is still served from the cache (the same bytes object).
    last = {"i": 39, "x": list(range(5000))}
    assert cache(last, "request.tools") is cache(last, "request.tools")


def test_a_huge_message_is_hashed_but_not_cached() -> None:
    cache = MessageDigestCache(max_bytes=1 << 20)
    message = {"role": "user", "content": "x" * 600_000}
    assert cache(message, "m") == message_digest(message, field="m")
    assert len(cache) == 0


def test_message_cache_is_cleared_when_its_bytes_are_full() -> None:
    cache = MessageDigestCache(max_bytes=100_000)
    for i in range(30):
        cache({"role": "user", "content": f"{i}" + "y" * 20_000}, "m")
        assert cache.bytes <= 100_000
    assert 0 < len(cache) < 30
