"""Huge arrays and objects in a body are refused before they are decoded (issue 27, critical).

A body of 22 million ``{}`` messages (63 MiB, under the body limit) decoded into 2 GB of Python
and held the interpreter lock for seconds before the schema's ``messages`` limit refused it.
Now the raw body's commas, brackets and braces are counted first (``--max-json-items``): these
tests shrink the limit so small bodies show each shape, and prove the count comes *before* the
decode with bodies that are not even JSON past their arrays (decoded, they would be a 400).
Memory and stalls with real 62 MiB bodies, three at once, are measured by
``bench/bench_big_body.py`` (docs/reports/reliability.md).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from capture_proxy.core.decode_budget import DecodeBudget
from capture_proxy.errors import CaptureUnavailable
from capture_proxy.schemas.records import CallStatus
from capture_proxy.schemas.request import (
    DEFAULT_MAX_JSON_ITEMS,
    RequestValidationError,
    check_body_items,
)

JSON = {"Content-Type": "application/json"}
HI = b'{"role":"user","content":"hi"}'


def _messages(item: bytes, n: int, tail: bytes = b"]}") -> bytes:
    return b'{"model":"policy","max_tokens":4,"messages":[' + item * n + HI + tail


SHAPES: dict[str, Callable[[bytes], bytes]] = {
    # What the issue sent, each at 2,000 values against a limit of 1,000.
    "empty messages": lambda tail: _messages(b"{},", 2_000, tail),
    "tiny valid messages": lambda tail: _messages(b'{"role":"user","content":"x"},', 700, tail),
    "empty content parts": lambda tail: (
        b'{"model":"policy","messages":[{"role":"user","content":['
        + b"{}," * 2_000
        + b'{"type":"text","text":"hi"}'
        + tail
    ),
    "logit_bias keys": lambda tail: (
        b'{"model":"policy","messages":['
        + HI
        + b'],"logit_bias":{'
        + b",".join(b'"%d":1' % i for i in range(2_000))
        + tail
    ),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_a_body_of_too_many_values_is_refused_before_it_is_decoded(
    make_proxy: Any, shape: str
) -> None:
    p = await make_proxy(max_json_items=1_000)
    # Cut short after its arrays: not JSON at all, so only a check before the decode sees it.
    body = SHAPES[shape](b"")
    resp = await p.client.post("/r/r1/v1/chat/completions", data=body, headers=JSON)
    assert resp.status == 413
    error = (await resp.json())["error"]
    assert error["code"] == "json_too_many_items"
    assert "more than 1000 JSON values" in error["message"]
    assert "--max-json-items" in error["message"]
    assert resp.headers["X-Capture-Status"] == CallStatus.REJECTED
    # In the rollout's ledger like any refused call: a visible gap, not a silent one.
    (entry,) = p.failures()
    assert entry.reason == "json_too_many_items"
    assert not p.calls()


async def test_the_same_shapes_under_the_limit_go_through(make_proxy: Any) -> None:
    p = await make_proxy(max_json_items=300_000)
    body = _messages(b'{"role":"user","content":"x"},', 700, b"]}")
    resp = await p.client.post("/r/r1/v1/chat/completions", data=body, headers=JSON)
    assert resp.status == 200, await resp.text()
    assert len(p.calls()) == 1


def test_the_default_limit_leaves_a_long_agent_conversation_alone() -> None:
    # About 128k tokens of prose full of commas (580 KB, 300 turns) and 20 tool schemas.
    prose = "Read the file, then list it, crop it, and plot it; then, finally, compare. " * 25
    messages = [{"role": "user" if i % 2 else "assistant", "content": prose} for i in range(300)]
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool{i}",
                "parameters": {
                    "type": "object",
                    "properties": {f"a{k}": {"type": "string"} for k in range(20)},
                },
            },
        }
        for i in range(20)
    ]
    body = orjson.dumps({"model": "policy", "messages": messages, "tools": tools})
    assert len(body) > 500_000
    check_body_items(body, DEFAULT_MAX_JSON_ITEMS)


def test_the_count_names_the_limit_and_stops_early() -> None:
    check_body_items(b"[" + b"{}," * 10 + b"{}]", 100)  # 11 commas, 1 bracket, 11 braces
    with pytest.raises(RequestValidationError) as caught:
        check_body_items(b"[" + b"1," * 5_000, 1_000)
    assert caught.value.status == 413
    assert caught.value.code == "json_too_many_items"
    assert caught.value.param == ""


# -- the budget of bodies decoded at once -----------------------------------------------------


async def test_decoding_takes_turns_in_order_of_arrival() -> None:
    budget = DecodeBudget(100, wait_s=5.0)
    order: list[str] = []
    release = asyncio.Event()

    async def decode(name: str, size: int) -> None:
        async with budget.hold(size):
            order.append(name)
            await release.wait()

    first = asyncio.create_task(decode("a 60", 60))
    await asyncio.sleep(0)
    big = asyncio.create_task(decode("b 70", 70))  # waits: 60 + 70 > 100
    await asyncio.sleep(0)
    small = asyncio.create_task(decode("c 10", 10))  # would fit, but b came first
    await asyncio.sleep(0.01)
    assert order == ["a 60"]
    assert budget.used == 60
    release.set()
    await asyncio.gather(first, big, small)
    assert order == ["a 60", "b 70", "c 10"]
    assert budget.used == 0


async def test_a_body_whose_turn_does_not_come_gets_503_with_retry_after() -> None:
    budget = DecodeBudget(100, wait_s=0.05)
    async with budget.hold(100):
        with pytest.raises(CaptureUnavailable) as caught:
            async with budget.hold(1):
                pass
    assert caught.value.status == 503
    assert caught.value.code == "decode_budget_full"
    assert caught.value.headers["Retry-After"] == "1"
    assert "--max-decoding-bytes" in caught.value.message
    assert budget.used == 0
    async with budget.hold(100):  # nothing left behind by the refused one
        assert budget.used == 100


async def test_a_client_that_leaves_while_waiting_gives_its_turn_back() -> None:
    budget = DecodeBudget(100, wait_s=5.0)
    async with budget.hold(90):
        waiting = asyncio.create_task(budget.hold(50).__aenter__())
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert budget.used == 0
    async with budget.hold(100):
        assert budget.used == 100


async def test_a_body_larger_than_the_budget_is_decoded_alone() -> None:
    budget = DecodeBudget(100, wait_s=1.0)
    async with budget.hold(10_000):
        assert budget.used == 100
    assert budget.used == 0


# -- body bytes per rollout per second ------------------------------------------------------------


async def test_a_rollout_sending_bodies_too_fast_gets_429_before_the_body_is_read(
    make_proxy: Any,
) -> None:
    # Receiving a body costs the loop ~1.6 ms per MiB whatever it holds: a sandbox sending large
    # bodies back to back is refused from its Content-Length, another rollout is not.
    # 10 KiB/s, 2 MiB saved (twice --max-body-bytes): the bucket refills far slower than the
    # calls take, however loaded the machine is, so the third body finds it short.
    p = await make_proxy(max_body_bytes=2**20, max_rollout_body_rate=0.01)
    body = _messages(b'{"role":"user","content":"' + b"x" * 100 + b'"},', 6_000, b"]}")
    assert 2 * 2**20 / 3 < len(body) < 2**20
    sent = [await p.client.post("/r/r1/v1/chat/completions", data=body, headers=JSON)]
    sent.append(await p.client.post("/r/r1/v1/chat/completions", data=body, headers=JSON))
    sent.append(await p.client.post("/r/r1/v1/chat/completions", data=body, headers=JSON))
    assert [r.status for r in sent[:2]] != [429, 429]
    refused = sent[2]
    assert refused.status == 429
    # The whole seconds until the bucket holds the body again: what it lacks at 10 KiB/s.
    lacking = len(body) - (2 * 2**20 - 2 * len(body))
    assert 0 <= math.ceil(lacking / (0.01 * 2**20)) - int(refused.headers["Retry-After"]) <= 1
    error = (await refused.json())["error"]
    assert error["code"] == "rollout_body_rate"
    assert "--max-rollout-body-rate" in error["message"]
    other = await p.client.post("/r/r2/v1/chat/completions", data=body, headers=JSON)
    assert other.status != 429
    assert [f.reason for f in p.failures() if f.http_status == 429] == ["rollout_body_rate"]


async def test_a_large_body_that_gets_no_turn_to_be_decoded_is_503_and_ledgered(
    make_proxy: Any,
) -> None:
    # What a client sees when other bodies hold --max-decoding-bytes past the wait: a 503 it
    # may retry, the call in the rollout's ledger, nothing staged or forwarded.
    p = await make_proxy(max_decoding_bytes=4 << 20)
    budget = p.state.pipeline.decode_budget
    budget.wait_s = 0.1
    body = _messages(b'{"role":"user","content":"' + b"x" * 100 + b'"},', 12_000, b"]}")
    assert len(body) > 1 << 20  # decoded on a worker thread, within the budget
    async with budget.hold(4 << 20):  # another body takes the whole budget meanwhile
        resp = await p.client.post("/r/r1/v1/chat/completions", data=body, headers=JSON)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["code"] == "decode_budget_full"
    assert [(f.reason, f.http_status) for f in p.failures()] == [("decode_budget_full", 503)]
    assert not p.calls()
    assert p.fake.requests == []
    assert (await p.client.post("/r/r1/v1/chat/completions", data=body, headers=JSON)).status != 503
