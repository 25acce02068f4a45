"""`inspect` says what token-in did: the rollout's choice, how many calls' plain rendering would
have diverged and where, the new segments and their reasons; and per call."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from capture_proxy.schemas.digest import seal_record
from capture_proxy.schemas.events import token_in_event
from capture_proxy.schemas.records import CallStatus
from capture_proxy.schemas.token_in_extras import SegmentBreak, token_in_extras
from capture_proxy.sinks.sqlite import SQLiteSink
from tests.inspect.test_inspect import inspect, inspect_json
from tests.support.sink_factories import Session


async def _store(tmp_path: Path) -> tuple[str, list[str]]:
    sink = SQLiteSink(str(tmp_path / "s.db"))
    session = Session("r-ti")
    notes = [
        token_in_extras(SegmentBreak("no_prior"), None),
        token_in_extras(None, 812),
        token_in_extras(SegmentBreak("history_edited", "message 2 changed"), 40),
    ]
    ids = []
    for extras in notes:
        record, _ = session.next()
        record = seal_record(replace(record, token_in=True, extras={**record.extras, **extras}))
        assert (await sink.stage(record)).status is CallStatus.STAGED
        ids.append(record.call_id)
    await sink.append_event(token_in_event("r-ti", True, 1))
    plain, _ = Session("r-plain").next()
    assert (await sink.stage(plain)).status is CallStatus.STAGED
    await sink.close()
    return f"sqlite:///{tmp_path / 's.db'}", ids


async def test_the_rollout_view_says_what_token_in_avoided(tmp_path: Path) -> None:
    url, ids = await _store(tmp_path)
    code, text = inspect(url, "--rollout", "r-ti")
    assert code == 0
    assert (
        "token-in: on for this rollout; 3 token-in call(s); plain rendering would have "
        "diverged in 2 of 3 (#1 at token 812, #2 at token 40); new segments: #0 no_prior, "
        "#2 history_edited"
    ) in text
    summary = inspect_json(url, "--rollout", "r-ti")["rollout"]["token_in"]
    assert summary == {
        "choice": True,
        "calls": 3,
        "measured": 3,
        "diverged": [
            {"seq": 1, "call_id": ids[1], "position": 812},
            {"seq": 2, "call_id": ids[2], "position": 40},
        ],
        "new_segments": [
            {"seq": 0, "call_id": ids[0], "reason": "no_prior", "detail": ""},
            {
                "seq": 2,
                "call_id": ids[2],
                "reason": "history_edited",
                "detail": "message 2 changed",
            },
        ],
    }
    # A rollout that never chose nor used token-in says nothing of it.
    assert "token-in" not in inspect(url, "--rollout", "r-plain")[1]
    assert "token_in" not in inspect_json(url, "--rollout", "r-plain")["rollout"]


async def test_the_call_view_says_where_the_plain_rendering_would_have_diverged(
    tmp_path: Path,
) -> None:
    url, ids = await _store(tmp_path)
    text = inspect(url, "--call", ids[2])[1]
    assert re.search(r"^  plain rendering +would have diverged at prompt token 40$", text, re.M)
    assert re.search(r"^  new segment +history_edited: message 2 changed$", text, re.M)
    call = inspect_json(url, "--call", ids[2])["call"]
    assert call["plain_divergence"] == 40
    assert call["token_in_break"] == {"reason": "history_edited", "detail": "message 2 changed"}
    text = inspect(url, "--call", ids[0])[1]
    assert re.search(r"^  plain rendering +would have been the same$", text, re.M)
