"""A free-form value repeated in `sampling` (a large `chat_template_kwargs`) is stored once, in
the request blob: the `sampling` column names it instead of repeating it (issue 19: one sandbox
could fill the store twice as fast), and the record reads back whole and verifies."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.sinks.codec import SAME_AS_REQUEST
from capture_proxy.sinks.registry import open_sink
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy, user

BIG = {"notes": ["x" * 100] * 200}  # ~20 KB of free-form JSON


def _stored_sampling(kind: str, tmp_path: Path) -> list[bytes]:
    if kind == "sqlite":
        with sqlite3.connect(tmp_path / "store.db") as conn:
            return [bytes(r[0]) for r in conn.execute("SELECT sampling FROM calls")]
    table = ds.dataset(tmp_path / "ds" / "calls", format="parquet").to_table(columns=["sampling"])
    return [bytes(v) for v in table.column("sampling").to_pylist()]


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_a_repeated_free_form_value_is_stored_once(kind: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/ds"
    p = await start_proxy(tmp_path, sink=open_sink(url))
    try:
        body: dict[str, Any] = chat_body(user("hi"), chat_template_kwargs=BIG, temperature=0.5)
        resp = await p.chat(body, rollout="ep")
        assert resp.headers["X-Capture-Status"] == "staged"
    finally:
        await stop_proxy(p)
    (stored,) = _stored_sampling(kind, tmp_path)
    assert len(stored) < 200  # the name, not the 20 KB
    assert SAME_AS_REQUEST.encode() in stored
    with open_store(url) as store:
        (record,) = store.calls("ep", include_open=True)  # verified on read
        store.verify()
    assert record.sampling["chat_template_kwargs"] == BIG
    assert record.sampling["temperature"] == 0.5
