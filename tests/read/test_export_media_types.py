"""An export states each row's image media types as its calls sent them: the same bytes sent as
image/png by one call and as image/jpeg by another are stored once, and the attachments file
holds them once, but each row's `attachment_media_types` says what its own call sent."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from capture_proxy.read.export import export_store
from capture_proxy.sinks.registry import open_sink
from tests.support.proxy_harness import chat_body


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_rows_carry_the_media_type_their_call_sent(
    make_proxy: Any, tmp_path: Path, kind: str
) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/m"
    p = await make_proxy(sink=open_sink(url))
    png = b"\x89PNG\r\n\x1a\n" + hashlib.sha256(b"labels").digest() * 32
    data = base64.b64encode(png).decode()
    for rollout_id, media_type in (("as-png", "image/png"), ("as-jpeg", "image/jpeg")):
        part = {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
        content = [{"type": "text", "text": "what is this"}, part]
        resp = await p.chat(chat_body({"role": "user", "content": content}), rollout=rollout_id)
        assert resp.headers["X-Capture-Status"] == "staged", await resp.text()
    sha = hashlib.sha256(png).hexdigest()
    for per in ("call", "trajectory", "segment"):
        out = tmp_path / f"{per}.parquet"
        export_store(url, str(out), per=per, include_open=True)
        rows = {r["rollout_id"]: r for r in pq.read_table(out).to_pylist()}
        for rollout_id, media_type in (("as-png", "image/png"), ("as-jpeg", "image/jpeg")):
            assert rows[rollout_id]["attachment_shas"] == [sha], per
            assert rows[rollout_id]["attachment_media_types"] == [media_type], per
        images = pq.read_table(tmp_path / f"{per}.attachments.parquet").to_pylist()
        assert [i["sha256"] for i in images] == [sha]  # the bytes once
