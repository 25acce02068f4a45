"""The parent search finds the call its definition names, among all of a rollout's calls.

A call's parent is the earlier call whose prompt + completion shares the longest common prefix
with its prompt (ties: the latest; retries of the same request excluded). `LineageIndex` is
checked against that definition computed by brute force, and through the proxy on both store
kinds, with the true parent older than the last 32 calls and again after a restart.
"""

from __future__ import annotations

import random
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture_proxy.core.lineage import BLOCK, LineageIndex
from capture_proxy.schemas.tokens import common_prefix_len, full_sequence
from capture_proxy.sinks.registry import open_sink, open_source
from tests.support.proxy_harness import Proxy, chat_body, start_proxy, stop_proxy, user

Call = tuple[int, str, "array[int]", bytes]


def by_definition(calls: list[Call], prompt: array[int], key: bytes) -> str | None:
    best: tuple[int, int] | None = None
    best_id = None
    for seq, call_id, full, k in calls:
        if k == key:
            continue
        shared = common_prefix_len(full, prompt)
        if shared > 0 and (best is None or (shared, seq) > best):
            best, best_id = (shared, seq), call_id
    return best_id


def _grow(rng: random.Random, base: array[int], cut: int, extra: int) -> array[int]:
    """`base` up to `cut`, then `extra` tokens of its own (a branch off it)."""
    out = array("i", base[:cut])
    out.extend(rng.randrange(0, 40) for _ in range(extra))
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60))
def test_the_index_agrees_with_the_definition(seed: int, n: int) -> None:
    rng = random.Random(seed)
    index = LineageIndex()
    calls: list[Call] = []
    keys = [bytes([k]) for k in range(6)]  # few keys: retries (shared keys) happen often
    for seq in range(n):
        # Branch off an earlier sequence near a block boundary, inside a block, or start afresh;
        # a small alphabet makes long accidental common prefixes likely too.
        if calls and rng.random() < 0.85:
            base = rng.choice(calls)[2]
            cut = rng.choice(
                [
                    len(base),
                    rng.randrange(len(base) + 1),
                    BLOCK * rng.randrange(0, 4) + rng.choice((-1, 0, 1)),
                ]
            )
            cut = max(0, min(cut, len(base)))
            prompt = _grow(rng, base, cut, rng.randrange(0, 2 * BLOCK))
        else:
            prompt = _grow(rng, array("i"), 0, rng.randrange(0, 3 * BLOCK))
        key = rng.choice(keys)
        assert index.choose(prompt, key) == by_definition(calls, prompt, key), seq
        full = _grow(rng, prompt, len(prompt), rng.randrange(0, BLOCK // 2))
        call_id = f"c{seq}"
        index.add(seq, call_id, full, key)
        calls.append((seq, call_id, full, key))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40))
def test_calls_indexed_out_of_seq_order_give_the_same_parents(seed: int, n: int) -> None:
    """Calls are usually indexed in seq order (the index's fast path); concurrent calls of one
    rollout can be staged in another order, which must not change any answer."""
    rng = random.Random(seed)
    keys = [bytes([k]) for k in range(4)]
    calls: list[Call] = []
    for seq in range(n):
        base = rng.choice(calls)[2] if calls and rng.random() < 0.8 else array("i")
        full = _grow(rng, base, rng.randrange(len(base) + 1), rng.randrange(0, 2 * BLOCK))
        calls.append((seq, f"c{seq}", full, rng.choice(keys)))
    index = LineageIndex()
    for seq, call_id, full, key in rng.sample(calls, len(calls)):
        index.add(seq, call_id, full, key)
    for _ in range(10):
        base = rng.choice(calls)[2]
        prompt = _grow(rng, base, rng.randrange(len(base) + 1), rng.randrange(0, BLOCK))
        key = rng.choice(keys)
        assert index.choose(prompt, key) == by_definition(calls, prompt, key)


def test_ties_go_to_the_latest_and_retries_are_no_parents() -> None:
    index = LineageIndex()
    seq_a = array("i", range(10, 10 + BLOCK + 5))
    index.add(0, "a", seq_a, b"k0")
    index.add(1, "b", seq_a, b"k1")  # the same sequence, later
    assert index.choose(array("i", [*seq_a, 7]), b"k9") == "b"
    assert index.choose(array("i", [*seq_a, 7]), b"k1") == "a"  # b is a retry of this request
    assert index.choose(array("i", [99]), b"k9") is None  # nothing shared


# -- through the proxy ----------------------------------------------------------------------


def _url(kind: str, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/ds"


async def _call(p: Proxy, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    resp = await p.chat(chat_body(*messages), rollout="ep")
    assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
    answer = (await resp.json())["choices"][0]["message"]
    return [*messages, {"role": "assistant", "content": answer["content"]}]


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_the_parent_can_be_older_than_the_last_32_calls(tmp_path: Path, kind: str) -> None:
    url = _url(kind, tmp_path)
    p = await start_proxy(tmp_path, sink=open_sink(url))
    try:
        task = await _call(p, [user("the long task " + "x" * 600)])
        # Side conversations in the same rollout (sub-agents, titles), each one call.
        sides = [await _call(p, [user(f"side question {i}")]) for i in range(40)]
        await _call(p, [*task, user("carry on with the task")])
    finally:
        await stop_proxy(p)
    # After a restart the index is rebuilt from the store: an old side conversation is found.
    p = await start_proxy(tmp_path, sink=open_sink(url))
    try:
        await _call(p, [*sides[2], user("more on that")])
    finally:
        await stop_proxy(p)
    src = open_source(url)
    try:
        calls = src.calls("ep")
    finally:
        src.close_reader()
    assert len(calls) == 43
    pairs = [(calls[41], calls[0]), (calls[42], calls[3])]
    assert [child.parent_call_id for child, _ in pairs] == [parent.call_id for _, parent in pairs]
    # The store holds only what follows the prefix shared with that parent.
    src = open_source(url)
    try:
        got = src.coords([child.call_id for child, _ in pairs])
    finally:
        src.close_reader()
    want = [
        common_prefix_len(
            full_sequence(par.prompt_token_ids, par.completion_token_ids), ch.prompt_token_ids
        )
        for ch, par in pairs
    ]
    assert [c.prev_len for c in got] == want
    assert min(want) > 32  # more than the chat template's own tokens: a real continuation
