"""A damaged store is reported as damaged, never as missing data."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from capture_proxy.cli import main
from capture_proxy.read.reader import RolloutUnverified, StoreCorrupted, open_store
from capture_proxy.sinks.base import StoreDamaged
from tests.support.proxy_harness import chat_body, user


async def test_missing_blob_is_damage_not_an_unknown_rollout(make_proxy: Any, capsys: Any) -> None:
    p = await make_proxy()
    await p.chat(chat_body(user("hello")), rollout="a")
    db = p.store_url.removeprefix("sqlite:///")
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM blobs WHERE rowid = (SELECT min(rowid) FROM blobs)")
    with open_store(p.store_url) as store:
        with pytest.raises(RolloutUnverified, match="blob is missing"):
            store.calls("a", include_open=True)
        with pytest.raises(StoreDamaged, match="blob is missing"):
            store.calls("a", include_open=True, verify=False)
        with pytest.raises(StoreCorrupted, match="blob is missing"):
            store.verify()
    assert main(["inspect", p.store_url, "--rollout", "a"]) == 2
    err = capsys.readouterr().err
    assert "no rollout" not in err
    assert "--verify" in err
    assert main(["inspect", p.store_url, "--verify"]) == 1
