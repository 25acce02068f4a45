"""Images in token-in calls through the real proxy, against the fake vLLM (the CPU test model is
text-only): appended images are bridged with generate's ``features`` for every image of the
prompt, earlier calls' included; features that do not agree go plain with
``multimodal_append``; a proxy restarted between calls continues from the placeholders the
records keep (``token_in_media``)."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from capture_proxy.core.token_in import _prompt as token_in_prompt_module
from capture_proxy.read.reader import open_store
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.schemas.token_in_extras import (
    MEDIA_KEY,
    SegmentBreak,
    media_of,
    segment_break_of,
)
from capture_proxy.sinks.registry import open_sink
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn
from tests.inspect.test_inspect import inspect
from tests.server.test_token_in_flow import SYSTEM, ask, assert_extends
from tests.support.proxy_harness import Proxy, start_proxy, stop_proxy, user

PAD = 9  # the fake's <|image_pad|>
RENDER = "/v1/chat/completions/render"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def image(data: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def with_image(text: str, data: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, image(data)]}


def generate_requests(p: Proxy) -> list[dict[str, Any]]:
    return [r for r in p.fake.requests if "token_ids" in r]


def placed(request: dict[str, Any]) -> list[tuple[str, int]]:
    """The (hash, offset) of each image generate was sent, each checked to be on a pad."""
    features = request["features"]
    ids = request["token_ids"]
    out = []
    for digest, span in zip(
        features["mm_hashes"]["image"], features["mm_placeholders"]["image"], strict=True
    ):
        assert ids[span["offset"] : span["offset"] + span["length"]] == [PAD] * span["length"]
        out.append((digest, span["offset"]))
    return out


async def test_appended_images_are_bridged_with_every_images_features(make_proxy: Any) -> None:
    p = await make_proxy(fake=FakeVLLM(scale_out=True, drop_past_reasoning=True), token_in="on")
    p.fake.push(
        Turn("What should I look at?", reasoning="Ask."),
        Turn("A cat.", reasoning="It is a cat."),
        Turn("A dog.", reasoning="Now a dog."),
        Turn("Both are pets."),
    )
    messages: list[dict[str, Any]] = [SYSTEM, user("I will show you pictures.")]
    _, replayed, _ = await ask(p, messages, stream=False)
    messages += [replayed, with_image("This one.", "AAAA")]
    _, replayed, _ = await ask(p, messages, stream=True)
    messages += [replayed, with_image("And this one.", "BBBB")]
    _, replayed, _ = await ask(p, messages, stream=False)
    messages += [replayed, user("What do they have in common?")]
    status, _, _ = await ask(p, messages, stream=True)
    assert status == "staged"
    records = p.calls()
    assert len(records) == 4
    assert_extends(records)
    assert [segment_break_of(r.extras) for r in records[1:]] == [None] * 3
    first, second, third, fourth = generate_requests(p)
    assert first.get("features") is None  # null: left out
    [cat] = placed(second)
    # The earlier image stays where it was; the new one is placed where the bridge put it.
    assert placed(third)[0] == cat
    [_, dog] = placed(third)
    assert placed(fourth) == [cat, dog]
    assert dog[1] > len(records[1].prompt_token_ids) + len(records[1].completion_token_ids)
    # The data is the request's own render's, item by item (the fake checks each hash).
    assert len(fourth["features"]["kwargs_data"]["image"]) == 2
    trajectory = open_store(p.store_url).trajectory("r1", include_open=True)
    assert len(trajectory.segments) == 1


class OtherImage(FakeVLLM):
    """The fake, its render of the call's own request seeing another image than the bridge's
    renders do (vLLM would not: this stands for any disagreement)."""

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def swap(request: web.Request, handler: Handler) -> web.StreamResponse:
            response = await handler(request)
            body = orjson.loads(await request.read()) if request.path == RENDER else {}
            dummy = {"role": "user", "content": "u"} in body.get("messages", [])
            if request.path != RENDER or dummy:
                return response
            assert isinstance(response, web.Response)
            assert response.body is not None
            answer = orjson.loads(bytes(response.body))  # type: ignore[arg-type]
            features = answer["features"]
            if features is not None:
                data = b"another picture"
                features["mm_hashes"]["image"][-1] = hashlib.sha256(data).hexdigest()
                features["kwargs_data"]["image"][-1] = base64.b64encode(data).decode()
            return web.json_response(answer)

        app.middlewares.append(swap)
        return app


async def test_features_that_disagree_with_the_requests_render_go_plain(make_proxy: Any) -> None:
    p = await make_proxy(fake=OtherImage(scale_out=True), token_in="on")
    p.fake.push(Turn("Show me."), Turn("A cat."))
    messages: list[dict[str, Any]] = [SYSTEM, user("I will show you a picture.")]
    _, replayed, _ = await ask(p, messages, stream=False)
    status, _, _ = await ask(p, [*messages, replayed, with_image("This one.", "AAAA")], stream=True)
    assert status == "staged"
    _, second = p.calls()
    cut = segment_break_of(second.extras)
    assert cut is not None
    assert cut.reason == "multimodal_append"
    assert cut.detail == (
        "the images' features: the `image` items (1) are not the request's render's (1) in "
        "the same order and sizes"
    )
    # The plain rendering was sent, with its render's features as they came.
    plain = generate_requests(p)[-1]
    assert plain["token_ids"] == list(second.prompt_token_ids)
    assert placed(plain)


async def image_session(
    tmp_path: Path, kind: str, *, restart: bool
) -> tuple[list[StagedCallRecord], list[dict[str, Any]], str]:
    """Three calls with images in their history (one at the start, one appended by the second
    call), through a proxy on a `kind` store, stopped and started again on the same store
    before each later call when `restart`: the records, what generate was sent, the store."""
    url = f"sqlite:///{tmp_path / 's.db'}" if kind == "sqlite" else f"parquet:///{tmp_path}/pq"
    upstream = FakeVLLM(scale_out=True, drop_past_reasoning=True)
    upstream.push(Turn("A cat.", reasoning="It purrs."), Turn("A dog."), Turn("Yes."))
    messages: list[dict[str, Any]] = [SYSTEM, with_image("What is this?", "AAAA")]
    appended = [with_image("And this?", "BBBB"), user("Sure?")]
    p = await start_proxy(tmp_path, fake=upstream, sink=open_sink(url), store=url, token_in="on")
    try:
        for n in range(3):
            if n and restart:
                await stop_proxy(p)
                p = await start_proxy(
                    tmp_path, fake=upstream, sink=open_sink(url), store=url, token_in="on"
                )
            status, replayed, _ = await ask(p, messages, stream=n == 1)
            assert status == "staged"
            messages += [replayed, appended[n]] if n < 2 else []
    finally:
        await stop_proxy(p)
    with open_store(url) as store:
        records = store.calls("r1", include_open=True)
    return records, generate_requests(p), url


@pytest.mark.parametrize("kind", ["sqlite", "parquet"])
async def test_after_a_proxy_restart_an_image_in_the_history_is_bridged_as_without_it(
    tmp_path: Path, kind: str
) -> None:
    restarted, sent, url = await image_session(tmp_path / "restarted", kind, restart=True)
    kept, sent_kept, _ = await image_session(tmp_path / "kept", kind, restart=False)
    assert len(restarted) == 3
    assert_extends(restarted)
    assert [segment_break_of(r.extras) for r in restarted[1:]] == [None, None]
    # Each call after a restart sent what it sends without one: the same ids, the same
    # features (the earlier images where they were, the appended one where the bridge put it).
    assert [(r["token_ids"], r.get("features")) for r in sent] == [
        (r["token_ids"], r.get("features")) for r in sent_kept
    ]
    for record, same in zip(restarted, kept, strict=True):
        said = {k: v for k, v in record.extras.items() if k != "upstream_response_id"}
        assert said == {k: v for k, v in same.extras.items() if k != "upstream_response_id"}
    assert len(placed(sent[2])) == 2
    # What the next call needed is in the records, each image's hash and placeholder range.
    for record, generated in zip(restarted, sent, strict=True):
        recorded = media_of(record.extras)
        assert recorded is not None
        assert [(m.hash, m.offset) for m in recorded] == placed(generated)
    with open_store(url) as store:
        store.verify()
        assert len(store.trajectory("r1", include_open=True).segments) == 1
    code, shown = inspect(url, "--call", restarted[2].call_id)
    assert code == 0
    assert re.search(r"\n  check +ok\n", shown)
    assert "token_in_media (239 B of JSON)" in shown  # named with its size, as long extras are


async def test_a_record_without_image_placeholders_says_so_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call with more placeholders than the proxy keeps records none (as records written
    before the proxy recorded them): the call after a restart is not continued, and says why."""
    upstream = FakeVLLM(scale_out=True, drop_past_reasoning=True)
    upstream.push(Turn("A cat.", reasoning="It purrs."), Turn("Yes."))
    messages: list[dict[str, Any]] = [SYSTEM, with_image("What is this?", "AAAA")]
    monkeypatch.setattr(token_in_prompt_module, "MEDIA_KEPT_BYTES", 0)
    p = await start_proxy(tmp_path, fake=upstream, token_in="on")
    try:
        _, replayed, _ = await ask(p, messages, stream=False)
        [first] = p.calls()
    finally:
        await stop_proxy(p)
    assert MEDIA_KEY not in first.extras
    monkeypatch.undo()
    p = await start_proxy(tmp_path, fake=upstream, token_in="on")
    try:
        status, _, _ = await ask(p, [*messages, replayed, user("Sure?")], stream=False)
        assert status == "staged"
        _, second = p.calls()
    finally:
        await stop_proxy(p)
    assert segment_break_of(second.extras) == SegmentBreak(
        "media_not_recorded",
        "1 images in the earlier messages, and the previous call's record (read back from the "
        "store) keeps no image placeholders (`token_in_media`): written before records kept "
        "them, more than the proxy keeps, or unreadable",
    )
    # Its own placeholders (the plain rendering's) are recorded: a next call can continue it.
    assert media_of(second.extras) is not None
    trajectory = open_store(p.store_url).trajectory("r1", include_open=True)
    assert [b.reason for b in trajectory.breaks] == ["media_not_recorded"]


async def test_without_a_restart_more_placeholders_than_kept_is_multimodal_history(
    make_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(token_in_prompt_module, "MEDIA_KEPT_BYTES", 0)
    p = await make_proxy(fake=FakeVLLM(scale_out=True), token_in="on")
    p.fake.push(Turn("A cat."), Turn("Yes."))
    messages: list[dict[str, Any]] = [SYSTEM, with_image("What is this?", "AAAA")]
    _, replayed, _ = await ask(p, messages, stream=False)
    await ask(p, [*messages, replayed, user("Sure?")], stream=True)
    _, second = p.calls()
    cut = segment_break_of(second.extras)
    assert cut is not None
    assert cut.reason == "multimodal_history"
