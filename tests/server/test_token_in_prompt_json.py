"""A token-in call's prompt ids go out as JSON encoded once: the pipeline keeps each line's last
staged prompt's JSON (`PromptJson`) so the next call's extends it, and drops the one it replaced."""

from __future__ import annotations

from typing import Any

import orjson

from tests.server.test_token_in_flow import fake, run_session


async def test_a_session_keeps_only_its_last_prompt_s_json_and_generate_got_each_prompt(
    make_proxy: Any,
) -> None:
    p = await make_proxy(fake=fake(), token_in="on")
    records = await run_session(p)
    # Generate got every prompt exactly, the bridged ones' JSON extending the previous one's.
    sent = [g["prompt_token_ids"] for g in p.fake.responses]
    assert sent == [list(r.prompt_token_ids) for r in records]
    kept = p.state.pipeline.prompt_json
    assert len(kept) == 1  # each staged call replaced the one before it
    [(_, prior)] = p.state.pipeline.capture.rollouts["r1"].token_in_priors.values()
    assert list(prior.prompt_ids) == list(records[-1].prompt_token_ids)
    assert orjson.loads(kept.get(prior.prompt_ids) or b"null") == list(prior.prompt_ids)
