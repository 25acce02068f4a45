"""A flood of refused calls in one rollout (issue 27's soak): past ``--max-rollout-refusal-rows``
a second its refusals are written to the ledger together, one entry a second that counts them,
and every client still gets its refusal and a call id that is in the ledger."""

from __future__ import annotations

import asyncio
import io
import re
from pathlib import Path
from typing import Any

from capture_proxy.core.refusal_folds import FOLD_REASON, folded_refusals
from capture_proxy.inspect.cli import main as inspect_main
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import CallStatus
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user

BAD = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}


async def test_a_flood_of_refusals_is_written_as_a_few_entries_that_count_every_one(
    tmp_path: Path,
) -> None:
    p = await start_proxy(tmp_path, max_rollout_refusal_rows=2)  # 4 on their own, then 2/s
    try:
        answers = await asyncio.gather(*(p.chat(BAD) for _ in range(40)))
        # Every client got the refusal it would have got, with a call id and its status.
        assert {a.status for a in answers} == {422}
        assert {a.headers["X-Capture-Status"] for a in answers} == {"rejected"}
        given = [a.headers["X-Capture-Call-Id"] for a in answers]
        codes = {(await a.json())["error"]["code"] for a in answers}
        [code] = codes
        # /metrics counts each refusal, folded or not.
        metrics = await (await p.client.get("/metrics")).text()
        [count] = re.findall(
            r'capture_proxy_calls_total\{outcome="rejected",reason="' + code + r'"[^}]*\} (\S+)',
            metrics,
        )
        assert float(count) == 40
        # An admitted call is untouched by its rollout's folds.
        assert (await p.chat(chat_body(user("a good one")))).status == 200
        await asyncio.sleep(1.5)  # the last fold is written a second after it opened
    finally:
        await stop_proxy(p)
    with open_store(p.store_url) as store:
        entries = store.failures("r1")
    # Read back: every id a client was given is in the ledger, rejected, and the entries
    # together stand for the 40 refusals; far fewer rows than calls.
    by_id = {e.call_id: e for e in entries}
    assert set(given) == set(by_id)
    assert all(e.status is CallStatus.REJECTED for e in entries)
    assert sum(folded_refusals(e) for e in entries) == 40
    assert len(entries) < 10
    folds = [e for e in entries if e.reason == FOLD_REASON]
    assert folds
    for fold in folds:
        assert fold.http_status == 422
        assert re.match(r"\d+ calls refused from \d+ to \d+ ", fold.message), fold.message
        assert f"{code} x" in fold.message
        assert "--max-rollout-refusal-rows 2" in fold.message
        assert given.count(fold.call_id) == folded_refusals(fold)
    # Sequence numbers stay one per entry, none twice, the staged call after them all.
    seqs = sorted(e.seq for e in entries)
    assert len(set(seqs)) == len(seqs)
    [staged] = p.calls()
    assert staged.seq == len(entries)
    # `capture-proxy inspect` shows the fold with its count.
    out = _inspect(p.store_url, "--rollout", "r1")
    assert f"{FOLD_REASON}: {folded_refusals(folds[0])} calls refused" in out


async def test_folds_are_written_before_the_proxy_stops(tmp_path: Path) -> None:
    p = await start_proxy(tmp_path, max_rollout_refusal_rows=1)
    try:
        await asyncio.gather(*(p.chat(BAD) for _ in range(10)))
    finally:
        await stop_proxy(p)  # within the fold's second
    with open_store(p.store_url) as store:
        assert sum(folded_refusals(e) for e in store.failures("r1")) == 10


async def test_zero_writes_every_refusal_on_its_own(make_proxy: Any) -> None:
    p = await make_proxy(max_rollout_refusal_rows=0)
    answers = await asyncio.gather(*(p.chat(BAD) for _ in range(30)))
    assert len({a.headers["X-Capture-Call-Id"] for a in answers}) == 30
    assert len(p.failures()) == 30
    assert FOLD_REASON not in {e.reason for e in p.failures()}


def _inspect(*argv: str) -> str:
    buf = io.StringIO()
    assert inspect_main(list(argv), stdout=buf) == 0
    return buf.getvalue()
