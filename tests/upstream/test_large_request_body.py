"""A large request body (an image session's, tens of MiB) reaches the upstream whole: the same
bytes and the same ``Content-Length``, though the proxy writes it in slices so that the event
loop serves other calls meanwhile (issue 27)."""

from __future__ import annotations

import base64
from pathlib import Path

import orjson

from tests.support.proxy_harness import start_proxy, stop_proxy


async def test_a_large_body_reaches_the_upstream_whole_with_its_length(tmp_path: Path) -> None:
    image = base64.b64encode(bytes(range(256)) * (24 * 2**20 // 256)).decode()  # 32 MiB
    body = {
        "model": "policy",
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                    {"type": "text", "text": "what is this?"},
                ],
            }
        ],
    }
    p = await start_proxy(tmp_path)
    try:
        resp = await p.chat(body)
        assert resp.status == 200
        assert resp.headers["X-Capture-Status"] == "staged"
        [got] = p.fake.requests
        [headers] = p.fake.request_headers
        # Not chunked: its length said up front, as for any other body.
        assert "Transfer-Encoding" not in headers
        assert int(headers["Content-Length"]) > 32 * 2**20
        assert got["messages"][0]["content"][0]["image_url"]["url"].endswith(image)
        assert len(orjson.dumps(got)) > 32 * 2**20
        [record] = p.calls()
        assert record.call_id == resp.headers["X-Capture-Call-Id"]
    finally:
        await stop_proxy(p)
