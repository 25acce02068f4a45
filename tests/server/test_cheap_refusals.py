"""Refusals that cost the proxy little (issue 27's soak: what the hostile load cost its CPU).

A body of 22 million ``{}`` was received whole (62 MiB, ~120 ms of the proxy's CPU to read and
parse) before ``--max-json-items`` refused it, and a large body over its rollout's body rate was
refused by dropping the connection, so its client saw a reset instead of the 429. Now the body's
values are counted as it arrives and it is refused the moment it passes the limit; a refused body
not received whole is read no further, and its connection closes a second after the answer. Each
such test is a raw socket that sends only the start of its body, so the answer it reads proves
the proxy did not wait for the rest. Connections refused at accept are logged as one line and a
count, not one line each. CPU per refusal is measured by ``bench/bench_hostile_cost.py``
(docs/reports/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import orjson
import pytest

from capture_proxy.testing.fake_vllm import FakeVLLM
from tests.server.test_slow_clients import (
    _until,
    answer_of,
    closed_within,
    head,
    honest_call,
    served,
)

FLOOD = "/r/flood/v1/chat/completions"


async def test_a_body_over_the_value_limit_is_refused_before_the_rest_of_it_is_sent(
    tmp_path: Path,
) -> None:
    async with served(tmp_path, max_json_items=1_000) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        start = b'{"model":"policy","messages":[' + b"{}," * 5_000
        # Announced as 8 MiB; only its first 15 KB are ever sent.
        writer.write(head(FLOOD, length=8 << 20) + start)
        status, headers, body = await answer_of(reader)
        assert status == 413
        error = orjson.loads(body)["error"]
        assert error["code"] == "json_too_many_items"
        assert "--max-json-items" in error["message"]
        assert headers["connection"] == "close"
        assert headers["x-capture-status"] == "rejected"
        # Closed after the answer though the body never finished: nothing waits for it.
        assert await closed_within(reader, within=5) == b""
        writer.close()
        assert [f.reason for f in s.failures("flood")] == ["json_too_many_items"]
        assert s.fake.requests == []
        # Another sandbox's call is answered as ever.
        assert (await honest_call(s.port))[0] == 200
        assert len(s.staged()) == 1


async def test_a_large_body_over_its_rollouts_body_rate_gets_the_429_and_is_not_received(
    tmp_path: Path,
) -> None:
    # 10 MiB bodies at most: the rollout's bucket holds 20 MiB, refilled at 10 KiB/s. Two
    # 9 MiB bodies take 18 MiB from their heads (the bucket is taken before a byte of the body
    # is read; their clients leave without sending one); the third finds 2 MiB.
    async with served(tmp_path, max_body_bytes=10 << 20, max_rollout_body_rate=0.01) as s:
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(head(FLOOD, length=9 << 20))
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(head(FLOOD, length=9 << 20) + b'{"model":"policy","messages":[' + b" " * 65536)
        # Before, this connection was dropped unanswered: the client saw a reset.
        status, headers, body = await answer_of(reader)
        assert status == 429
        assert orjson.loads(body)["error"]["code"] == "rollout_body_rate"
        assert int(headers["retry-after"]) > 60
        assert headers["connection"] == "close"
        assert await closed_within(reader, within=5) == b""
        writer.close()
        assert [f.reason for f in s.failures("flood") if f.http_status == 429] == [
            "rollout_body_rate"
        ]
        assert s.fake.requests == []
        assert (await honest_call(s.port))[0] == 200


async def test_a_body_sent_in_pieces_is_counted_whole_and_goes_through_at_the_limit(
    tmp_path: Path,
) -> None:
    body = orjson.dumps(
        {"model": "policy", "messages": [{"role": "user", "content": "a, b, [c], {d}"}] * 30}
    )
    values = sum(body.count(c) for c in (b",", b"[", b"{"))
    for limit, status in ((values, 200), (values - 1, 413)):
        async with served(tmp_path / str(limit), max_json_items=limit) as s:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(head(length=len(body)))
            for at in range(0, len(body), 100):  # in pieces the proxy receives one by one
                writer.write(body[at : at + 100])
                await writer.drain()
                await asyncio.sleep(0.002)
            assert (await answer_of(reader))[0] == status
            writer.close()


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "capture_proxy.connections"]


async def test_a_flood_of_refused_connections_is_logged_as_one_line_then_a_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One new connection per 10 s from an address: the first is admitted, the next five are
    # refused at accept, each with its 503.
    with caplog.at_level(logging.WARNING, logger="capture_proxy.connections"):
        async with served(tmp_path, max_connection_rate_per_address=0.1) as s:
            opened = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(6)]
            for reader, _ in opened[1:]:
                assert (await answer_of(reader))[0] == 503
            assert s.listening.gate.refused_rate == 5  # /metrics counts every one
            lines = refusal_lines(caplog)
            assert len(lines) == 1
            assert lines[0].startswith("refused a client connection: its address opens more")
            s.listening.gate.flush_log(all_windows=True)  # as `serve` does every 10 s and at exit
            lines = refusal_lines(caplog)
            assert len(lines) == 2
            assert lines[1].startswith("4 more like this not logged in 0s: refused a client ")
            for _, writer in opened:
                writer.close()


async def test_a_call_over_its_rollouts_in_flight_limit_is_refused_from_its_head(
    tmp_path: Path,
) -> None:
    # Before, its body was read, decoded and its rollout loaded before admission refused it.
    fake = FakeVLLM(latency=2.0)
    async with served(tmp_path, fake, max_inflight_per_rollout=1) as s:
        busy = asyncio.create_task(honest_call(s.port, FLOOD))
        await _until(lambda: len(fake.requests) == 1, within=10)
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(head(FLOOD, length=1 << 20))  # its body never comes
        status, headers, body = await answer_of(reader)
        assert status == 429
        assert orjson.loads(body)["error"]["code"] == "too_many_inflight_rollout"
        assert headers["connection"] == "close"
        assert headers["x-capture-status"] == "rejected"
        assert await closed_within(reader, within=5) == b""
        writer.close()
        assert (await busy)[0] == 200
        assert [f.reason for f in s.failures("flood")] == ["too_many_inflight_rollout"]
        assert len(fake.requests) == 1
        # Another rollout is not held to it.
        assert (await honest_call(s.port))[0] == 200
