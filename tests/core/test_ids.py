"""Ids the proxy makes cannot be guessed from the ones a sandbox has seen (issue 19).

Before, ids made in the same millisecond were the previous id + 1 (a "monotonic" ULID): 75 of 100
server-made ids were predictable from the one before. Now every id carries 80 fresh random bits.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from typing import Any

import orjson

from capture_proxy.core.ids import RANDOM_BITS, new_call_id

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
ULID = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")


def _parts(call_id: str) -> tuple[int, int]:
    """(milliseconds, random part) of a ULID-shaped id."""
    value = 0
    for ch in call_id.upper():
        value = value * 32 + CROCKFORD.index(ch)
    return value >> RANDOM_BITS, value & ((1 << RANDOM_BITS) - 1)


def test_ids_made_in_one_millisecond_share_nothing_but_the_time() -> None:
    ids = [new_call_id(now_ms=1_700_000_000_000) for _ in range(10_000)]
    assert all(ULID.fullmatch(i) for i in ids)
    times, randoms = zip(*(_parts(i) for i in ids), strict=True)
    assert set(times) == {1_700_000_000_000}
    assert len(set(randoms)) == len(ids)  # no two share their random part
    # Not a counter: no id is its predecessor plus a small step (the old ids were +1 each time).
    steps = [b - a for a, b in itertools.pairwise(randoms)]
    assert sum(1 for d in steps if 0 < d < 2**40) == 0
    assert 0.4 < sum(1 for d in steps if d > 0) / len(steps) < 0.6  # up or down, at random


def test_every_random_bit_is_set_about_half_the_time() -> None:
    randoms = [_parts(new_call_id())[1] for _ in range(4_000)]
    for bit in range(RANDOM_BITS):
        ones = sum((r >> bit) & 1 for r in randoms)
        assert 1_700 < ones < 2_300, (bit, ones)  # 4,000 fair coins: within 10 sigma


def test_ids_still_sort_by_millisecond() -> None:
    earlier = [new_call_id(now_ms=1_700_000_000_000) for _ in range(50)]
    later = [new_call_id(now_ms=1_700_000_000_001) for _ in range(50)]
    assert max(earlier) < min(later)


async def test_ids_the_proxy_answers_with_are_not_predictable(make_proxy: Any) -> None:
    p = await make_proxy(admin_token="t" * 32)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    call_ids = []
    for _ in range(100):
        resp = await p.chat(body)
        call_ids.append(resp.headers["X-Capture-Call-Id"])
    rollout_ids = []
    for _ in range(100):
        resp = await p.client.post(
            "/admin/rollouts", data=b"{}", headers={"Authorization": "Bearer " + "t" * 32}
        )
        assert resp.status == 201
        rollout_ids.append(orjson.loads(await resp.read())["rollout_id"])
    for ids in (call_ids, [r.removeprefix("ro-") for r in rollout_ids]):
        randoms = [_parts(i)[1] for i in ids]
        assert len(set(randoms)) == len(ids)
        predictable = sum(1 for a, b in itertools.pairwise(randoms) if 0 < b - a < 2**40)
        assert predictable == 0, ids  # issue 19 found 75 of 100 were the previous id + 1
        assert Counter(len(i) for i in ids) == Counter({26: len(ids)})
