"""Images in token-in calls through the real proxy, against the fake vLLM (the CPU test model is
text-only): appended images are bridged with generate's ``features`` for every image of the
prompt, earlier calls' included; features that do not agree go plain with
``multimodal_append``."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from capture_proxy.read.reader import open_store
from capture_proxy.schemas.token_in_extras import segment_break_of
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn
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
    assert first["features"] is None
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


async def test_after_a_proxy_restart_an_image_in_the_history_starts_a_new_segment(
    tmp_path: Path,
) -> None:
    upstream = FakeVLLM(scale_out=True, drop_past_reasoning=True)
    upstream.push(Turn("A cat."), Turn("Yes."))
    messages: list[dict[str, Any]] = [SYSTEM, with_image("What is this?", "AAAA")]
    p = await start_proxy(tmp_path, fake=upstream, token_in="on")
    try:
        _, replayed, _ = await ask(p, messages, stream=False)
    finally:
        await stop_proxy(p)
    p = await start_proxy(tmp_path, fake=upstream, token_in="on")
    try:
        status, _, _ = await ask(p, [*messages, replayed, user("Sure?")], stream=False)
        assert status == "staged"
        _, second = p.calls()
    finally:
        await stop_proxy(p)
    # Read back from the store, the previous call cannot be continued: its record keeps the
    # image as an attachment (so its messages are not the request's), and no placeholders.
    cut = segment_break_of(second.extras)
    assert cut is not None
    assert cut.reason == "history_edited"
    assert cut.detail.startswith("message 1: ")
