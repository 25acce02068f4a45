"""The proxy's one reader on its store (`SharedReader`): on a Parquet store it is the sink's own
reader, lent (`SinkWithSource`), so the process holds one units index of the store, not two; it
keeps a key per call only once a read by key needs one (a trainer reading through the proxy)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from capture_proxy.core.shared_reader import SharedReader
from capture_proxy.read.reader import open_store
from capture_proxy.sinks.base import SinkWithSource
from capture_proxy.sinks.parquet import ParquetSink, ParquetSource
from capture_proxy.sinks.parquet._index import UnitIndex
from tests.support.proxy_harness import ProxyFactory, chat_body, user
from tests.support.sink_factories import Session

ADMIN_TOKEN = "admin-token-for-shared-reader-0123"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _index(source: object) -> UnitIndex:
    assert isinstance(source, ParquetSource)
    idx = source._index
    assert isinstance(idx, UnitIndex)
    return idx


async def test_a_proxy_on_a_parquet_store_reads_through_the_sinks_own_reader(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    sink = ParquetSink(str(tmp_path / "pq"))
    p = await make_proxy(sink=sink, admin_token=ADMIN_TOKEN)
    assert isinstance(sink, SinkWithSource)
    shared = p.state.capture.source
    assert isinstance(shared, SharedReader)
    # One reader, one index: the writer's, lent to the proxy.
    assert shared() is sink.own_source() is sink._reader
    messages = [user("hello")]
    for turn in range(3):
        resp = await p.chat(chat_body(*messages, max_tokens=8), rollout="one-index")
        assert resp.headers["X-Capture-Status"] == "staged"
        answer = (await resp.json())["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, user(f"and {turn}?")]
    sealed = await p.client.post("/admin/rollouts/one-index/seal", headers=ADMIN)
    assert sealed.status == 200
    staged = [c["call_id"] for c in (await sealed.json())["calls"]]
    # Sealed, it is released from memory: its manifest is rebuilt from the store through the
    # lent reader, as a restarted proxy's would be: the same calls, read through the rollout,
    # with no key per call.
    assert "one-index" not in p.state.capture.rollouts
    again = await p.client.get("/admin/rollouts/one-index/manifest", headers=ADMIN)
    assert again.status == 200
    assert [c["call_id"] for c in (await again.json())["calls"]] == staged
    assert _index(shared()).calls is None
    # Closing the shared reader leaves the sink's reader to the sink: the writer still uses it.
    shared.close()
    assert shared() is sink.own_source()
    assert sink.own_source().rollouts() == ["one-index"]


async def test_a_read_by_key_through_the_proxy_starts_keeping_call_keys(
    make_proxy: ProxyFactory, tmp_path: Path
) -> None:
    sink = ParquetSink(str(tmp_path / "pq"))
    p = await make_proxy(sink=sink, admin_token=ADMIN_TOKEN)
    for rollout in ("a", "b"):
        resp = await p.chat(chat_body(user(f"hi {rollout}"), max_tokens=8), rollout=rollout)
        assert resp.headers["X-Capture-Status"] == "staged"
    lent = sink.own_source()
    assert _index(lent).calls is None  # the writer finds calls through their rollouts
    lent.close_reader()  # nothing read lately: a read by key must find the call in the store
    local = open_store(sink.url)
    keys = [r.call_id for rollout in ("a", "b") for r in local.source.calls(rollout)]
    url = str(p.client.make_url("")).rstrip("/")

    def fetch() -> list[str]:
        with open_store(url, token=ADMIN_TOKEN) as remote:
            return [r.digest for r in remote.source.fetch(keys)]

    assert await asyncio.to_thread(fetch) == [r.digest for r in local.source.fetch(keys)]
    assert len(_index(lent).calls or ()) == len(keys)
    # Later units file their calls' keys as they are indexed.
    resp = await p.chat(chat_body(user("hi c"), max_tokens=8), rollout="c")
    assert resp.headers["X-Capture-Status"] == "staged"
    lent.close_reader()
    (record,) = local.source.calls("c")
    assert lent.fetch([record.call_id])[0].digest == record.digest
    assert len(_index(lent).calls or ()) == len(keys) + 1

    def unknown() -> None:
        with open_store(url, token=ADMIN_TOKEN) as remote:
            remote.source.fetch(["no-such-call"])

    # A key the store does not have is still a 404 naming it.
    with pytest.raises(KeyError, match="no-such-call"):
        await asyncio.to_thread(unknown)
    local.close()


async def test_a_keyless_reader_builds_its_call_keys_only_when_asked(tmp_path: Path) -> None:
    ds = str(tmp_path / "ds")
    sink = ParquetSink(ds)
    sessions = [Session(f"r{i}", seed=i) for i in range(3)]
    for _ in range(3):
        for s in sessions:
            record, atts = s.next()
            await sink.stage(record, attachments=atts)
    await sink.close()
    full = ParquetSource(ds)
    on_demand = ParquetSource(ds, index="units", call_keys="on_demand")
    keyless = ParquetSource(ds, index="units", call_keys=False)
    for s in sessions:
        # Reads through the rollout (a resume) need no key per call.
        calls = on_demand.calls(s.rollout_id)
        keys = [r.call_id for r in calls]
        assert on_demand.coords(keys) == full.coords(keys)
        last = keys[-1]
        assert on_demand.full(last, s.rollout_id) == full.full(last)
    assert _index(on_demand).calls is None
    on_demand.close_reader()
    keyless.close_reader()
    last = full.calls("r1")[-1].call_id
    with pytest.raises(KeyError):
        keyless.full(last)  # never keyed: only through its rollout
    assert on_demand.full(last) == full.full(last)
    assert len(_index(on_demand).calls or ()) == 9
    with pytest.raises(KeyError):
        on_demand.fetch(["no-such-call"])
