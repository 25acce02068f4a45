"""A staged request keeps the client's key order: chat templates render in that order."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture_proxy.schemas.digest import seal_record
from tests.support.sink_factories import SINKS, Session


@pytest.mark.parametrize("kind", sorted(SINKS))
async def test_request_keys_read_back_in_the_order_they_were_sent(
    tmp_path: Path, kind: str
) -> None:
    case = SINKS[kind](tmp_path)
    record, _ = Session("r1").next()
    schema = {"type": "object", "properties": {"z_last": {"type": "string"}, "a_first": {}}}
    request = {
        "tools": [{"type": "function", "function": {"name": "t", "parameters": schema}}],
        "model": "m",
        "messages": list(record.request["messages"]),
        "temperature": 0.5,
    }
    from dataclasses import replace

    sealed = seal_record(replace(record, request=request))
    assert (await case.sink.stage(sealed)).status == "staged"
    await case.sink.close()
    (back,) = case.reopen().fetch([sealed.call_id])
    assert list(back.request) == ["tools", "model", "messages", "temperature"]
    props = back.request["tools"][0]["function"]["parameters"]["properties"]
    assert list(props) == ["z_last", "a_first"]
    assert back.digest == sealed.digest
