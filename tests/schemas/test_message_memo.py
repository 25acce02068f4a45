"""`MessageMemo`: a rollout's re-sent messages are hashed once, to exactly the digests and blob
keys computed without it, within its per-rollout and total byte bounds."""

from __future__ import annotations

import hashlib
import tracemalloc
from typing import Any

import orjson
import pytest

from capture_proxy.schemas.digest import EncodingError, message_digest
from capture_proxy.schemas.message_memo import ENTRY_OVERHEAD, MessageMemo, rollout_digester


def _session(turns: int) -> list[list[dict[str, Any]]]:
    """Each call's messages, decoded afresh from JSON (as the proxy sees them)."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    calls = []
    for t in range(turns):
        history = [
            *history,
            {"role": "user", "content": f"turn {t}", "name": None},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{t}", "n": t}]},
        ]
        calls.append(orjson.loads(orjson.dumps(history)))
    return calls


def test_digests_through_the_memo_are_the_plain_digests_and_each_message_is_hashed_once() -> None:
    memo: MessageMemo[bytes] = MessageMemo()
    digest = rollout_digester(memo, "r")
    computed = 0
    for messages in _session(6):
        for i, m in enumerate(messages):
            assert digest(m, f"m[{i}]") == message_digest(m, field=f"m[{i}]")
        computed = memo.misses
    assert computed == 1 + 2 * 6  # every distinct message once
    assert memo.hits == sum(len(m) for m in _session(6)) - computed


def test_rollouts_do_not_share_entries() -> None:
    memo: MessageMemo[str] = MessageMemo()
    data = b'{"role":"user","content":"hi"}'
    assert memo.get("a", data, lambda: "A") == "A"
    assert memo.get("b", data, lambda: "B") == "B"
    assert memo.get("a", data, lambda: "x") == "A"
    memo.forget("a")
    assert memo.get("a", data, lambda: "again") == "again"


def test_messages_sharing_a_fingerprint_are_told_apart_by_their_bytes() -> None:
    # Same length, same first and last 48 bytes: only the middle differs.
    one = b"[" + b"a" * 60 + b"1" + b"z" * 60 + b"]"
    two = b"[" + b"a" * 60 + b"2" + b"z" * 60 + b"]"
    memo: MessageMemo[str] = MessageMemo()
    for _ in range(2):
        assert memo.get("r", one, lambda: hashlib.sha256(one).hexdigest()) == (
            hashlib.sha256(one).hexdigest()
        )
        assert memo.get("r", two, lambda: hashlib.sha256(two).hexdigest()) == (
            hashlib.sha256(two).hexdigest()
        )
    assert len(memo) == 1  # the first one kept; the other is computed each time


def test_a_rollout_keeps_its_first_messages_within_its_share() -> None:
    memo: MessageMemo[int] = MessageMemo(max_rollout_bytes=10_000, max_bytes=100_000)
    blobs = [b"%04d" % i + b"x" * 1_000 for i in range(30)]
    for _ in range(2):
        for i, data in enumerate(blobs):
            assert memo.get("r", data, lambda i=i: i) == i  # type: ignore[misc]
    assert memo.bytes <= 10_000
    kept = 10_000 // (1_004 + ENTRY_OVERHEAD)
    assert len(memo) == kept
    assert memo.hits == kept  # the second pass: the oldest messages were the ones kept


def test_a_message_over_a_rollouts_share_is_computed_but_never_kept() -> None:
    memo: MessageMemo[str] = MessageMemo(max_rollout_bytes=1 << 20)
    huge = b"y" * (2 << 20)
    assert memo.get("r", huge, lambda: "v") == "v"
    assert len(memo) == 0
    assert memo.bytes == 0


def test_the_least_recently_used_rollout_goes_when_all_of_them_are_full() -> None:
    memo: MessageMemo[int] = MessageMemo(max_rollout_bytes=50_000, max_bytes=120_000)
    for r in range(5):
        for i in range(40):
            memo.get(f"r{r}", b"%d-%d" % (r, i) + b"m" * 1_000, lambda i=i: i)  # type: ignore[misc]
            assert memo.bytes <= 120_000
    assert memo.get("r0", b"0-0" + b"m" * 1_000, lambda: -1) == -1  # dropped
    assert memo.get("r4", b"4-0" + b"m" * 1_000, lambda: -1) == 0  # still held


def test_a_message_without_a_canonical_encoding_is_refused_as_without_the_memo() -> None:
    memo: MessageMemo[bytes] = MessageMemo()
    digest = rollout_digester(memo, "r")
    with pytest.raises(EncodingError, match=r"request\.messages\[0\]\.n: integer .* int64"):
        digest({"role": "user", "n": 2**63}, "request.messages[0]")
    assert len(memo) == 0


def test_a_str_subclass_is_refused_even_when_its_plain_twin_is_remembered() -> None:
    class Text(str):
        pass

    memo: MessageMemo[bytes] = MessageMemo()
    digest = rollout_digester(memo, "r")
    digest({"role": "user", "content": "hi"}, "m")
    with pytest.raises(EncodingError, match="Text has no canonical encoding"):
        digest({"role": "user", "content": Text("hi")}, "request.messages[0]")


def test_the_byte_bound_counts_what_the_memo_really_holds() -> None:
    # orjson's output keeps the capacity it grew to (~16 KB for a 2 KB message): the memo keeps
    # an exact-size copy, so what it counts is what it holds.
    memo: MessageMemo[int] = MessageMemo()
    messages = [orjson.dumps({"role": "user", "content": f"{i}" + "x" * 2_000}) for i in range(50)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, data in enumerate(messages):
            memo.get("r", data, lambda i=i: i)  # type: ignore[misc]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert memo.bytes >= 50 * 2_000
    assert held <= memo.bytes
