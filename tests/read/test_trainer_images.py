"""The images a trainer adapter hands over for a segment: one per image part of the segment's
prompt, in prompt order, an image sent twice listed twice (a VL processor pairs them with the
prompt's placeholder runs one by one). Staged through a real proxy in front of the fake vLLM;
tests/e2e/test_vlm.py holds the same to a real VLM and verl's own placement."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from capture_proxy import open_store
from capture_proxy.read.trainers import episodes, to_verl
from capture_proxy.testing.fake_vllm import FakeVLLM, Turn
from tests.support.proxy_harness import chat_body, start_proxy, stop_proxy
from tests.support.trainer_rollouts import ADMIN, TOKEN, png


def parts(*images: bytes) -> list[dict[str, Any]]:
    return [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(i)}}
        for i in images
    ]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def test_a_segments_images_are_its_prompts_image_parts_repeats_kept(tmp_path: Path) -> None:
    task, crop = png(56, 28), png(28, 28)
    p = await start_proxy(tmp_path, fake=FakeVLLM(), admin_token=TOKEN)
    try:
        made = await p.client.post("/admin/rollouts", json={"rollout_id": "r-img"}, headers=ADMIN)
        assert made.status == 201, await made.text()
        p.fake.push(Turn("I see a task."), Turn("Same layout."))
        first = {"role": "user", "content": [{"type": "text", "text": "Fix it."}, *parts(task)]}
        resp = await p.chat(chat_body(first), rollout="r-img")
        assert resp.status == 200, await resp.text()
        answer = {
            "role": "assistant",
            "content": (await resp.json())["choices"][0]["message"]["content"],
        }
        # The crop, then the task image again: the second call's prompt has three image parts.
        again = {"role": "user", "content": parts(crop, task)}
        resp = await p.chat(chat_body(first, answer, again), rollout="r-img")
        assert resp.status == 200, await resp.text()
        await resp.read()
        sealed = await p.client.post("/admin/rollouts/r-img/seal", headers=ADMIN)
        assert sealed.status == 200, await sealed.text()
        graded = await p.client.put(
            "/admin/rollouts/r-img/outcome", json={"reward": 1.0}, headers=ADMIN
        )
        assert graded.status == 200, await graded.text()
    finally:
        await stop_proxy(p)
    with open_store(p.store_url) as store:
        (sample,) = to_verl(episodes(store))
    images = sample["output"]["multi_modal_data"]["images"]
    assert images == [{"bytes": task}, {"bytes": crop}, {"bytes": task}]
