"""The proxy in front of a real vLLM 0.32 (CPU) serving a tiny vision-language model
(scripts/tiny_vlm.py: Qwen2.5-VL, random weights): image turns, plain and token-in.

`-m vllm`. Images are data URLs (PNG, JPEG, WebP, made by Pillow) in user messages and in tool
results, several a turn, one of them twice. Each staged record is held to vLLM's own answers for
the same request: its prompt ids to the chat route's ``prompt_token_ids``, its image placeholders
to render's ``features.mm_placeholders``, which must sit exactly on the runs of the image pad id
in the prompt. Calls are never overlapped (batching can flip a random model's near-tied picks).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import sqlite3
import subprocess
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from capture_proxy.read.reader import open_store
from capture_proxy.read.trainers import episodes, to_verl
from capture_proxy.schemas.records import StagedCallRecord
from capture_proxy.schemas.token_in_extras import media_of, segment_break_of
from examples.rl_loop.agent import TOOLS
from scripts import opencode_env, tiny_vlm, trainer_env
from tests.e2e import test_vllm
from tests.e2e.test_vllm import as_forwarded, direct, stream_through
from tests.support import ROOT
from tests.support.proxy_harness import Proxy, start_proxy, stop_proxy
from tests.support.replay import Answer, read_answer, replayed
from tests.support.trainer_rollouts import _jsonable as jsonable

pytestmark = pytest.mark.vllm
ADMIN = {"Authorization": "Bearer e2e-admin-token"}  # the e2e proxies' admin token (control.TOKEN)

SYSTEM = {"role": "system", "content": "You are a visual coding agent. Use the tools."}
CROP_CALL = {
    "id": "call_crop_1",
    "type": "function",
    "function": {"name": "bash", "arguments": '{"command": "python crop.py"}'},
}


@pytest.fixture(scope="module")
def images(vlm_paths: tiny_vlm.Paths) -> dict[str, str]:
    """Data URLs: a task image (PNG), a photo (JPEG), a crop (WebP), a plot (PNG)."""
    specs = [("PNG", 96, 64, 1), ("JPEG", 150, 100, 2), ("WEBP", 56, 56, 3), ("PNG", 200, 40, 4)]
    urls = tiny_vlm.make_images(vlm_paths, specs)
    return dict(zip(("task", "photo", "crop", "plot"), urls, strict=True))


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image_session(images: dict[str, str]) -> list[dict[str, Any]]:
    """A visual coding turn: the task image and a photo, a crop tool call, its result followed by
    the crop and the task image again (as OpenAI's API and OpenCode carry a tool's images: in a
    user message after the tool message), then a user message with a plot."""
    return [
        SYSTEM,
        {
            "role": "user",
            "content": [text("Fix the layout."), image(images["task"]), image(images["photo"])],
        },
        {"role": "assistant", "content": "", "tool_calls": [CROP_CALL]},
        {"role": "tool", "tool_call_id": "call_crop_1", "content": "crop.png written"},
        {"role": "user", "content": [image(images["crop"]), image(images["task"])]},
        {"role": "user", "content": [text("And the plot:"), image(images["plot"])]},
    ]


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "model": "policy",
        "messages": messages,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 12,
        **extra,
    }


def pad_runs(prompt: Sequence[int]) -> list[dict[str, int]]:
    """Where the image pad id sits in `prompt`: one {offset, length} per run."""
    runs: list[dict[str, int]] = []
    for i, token in enumerate(prompt):
        if token != tiny_vlm.IMAGE_PAD_ID:
            continue
        if runs and runs[-1]["offset"] + runs[-1]["length"] == i:
            runs[-1]["length"] += 1
        else:
            runs.append({"offset": i, "length": 1})
    return runs


async def render(url: str, request: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own render of `request` (/v1/chat/completions/render): token_ids and features.
    Streaming keys are dropped: render refuses them."""
    request = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{url}/v1/chat/completions/render", json=request) as resp,
    ):
        assert resp.status == 200, await resp.text()
        rendered: dict[str, Any] = await resp.json()
        return rendered


def data_of(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


def with_data(request: Any, images: dict[str, str]) -> dict[str, Any]:
    """A staged request with its attachment references replaced by the images' data URLs."""
    by_ref = {
        f"attachment:sha256:{hashlib.sha256(data_of(u)).hexdigest()}": u for u in images.values()
    }
    restored: dict[str, Any] = json.loads(
        json.dumps(dict(request)),
        object_hook=lambda o: {k: by_ref.get(v, v) if k == "url" else v for k, v in o.items()},
    )
    return restored


def attachment_refs(request: Any) -> list[str]:
    """The image URLs of a staged request, in message order."""
    return [
        part["image_url"]["url"]
        for message in request["messages"]
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image_url"
    ]


async def assert_vllm_renders_it(url: str, record: StagedCallRecord, sent: dict[str, Any]) -> None:
    """The record's prompt is vLLM's own for the request sent, and its image placeholders are
    render's, exactly on the runs of the image pad id."""
    forwarded = as_forwarded(sent)
    prompt, _, _ = await direct(url, forwarded)
    assert record.prompt_token_ids.tolist() == prompt
    rendered = await render(url, forwarded)
    assert rendered["token_ids"] == prompt
    placeholders = rendered["features"]["mm_placeholders"]["image"]
    assert [{"offset": p["offset"], "length": p["length"]} for p in placeholders] == pad_runs(
        prompt
    )


async def test_image_turns_stage_vllms_own_prompt_and_placeholders(
    vlm_url: str, tmp_path: Path, images: dict[str, str]
) -> None:
    p = await start_proxy(tmp_path, upstream=vlm_url)
    rollout = "vlm-plain"
    messages = image_session(images)
    try:
        unary = body(messages[:5])
        resp = await p.chat(unary, rollout=rollout)
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Capture-Status"] == "staged"
        await resp.read()
        streamed = body(messages, stream=True)
        await stream_through(p, rollout, streamed)
        r1, r2 = p.calls(rollout)
        await assert_vllm_renders_it(vlm_url, r1, unary)
        await assert_vllm_renders_it(vlm_url, r2, streamed)
        # Each image became its own placeholder run: 4 in the first call, 5 in the second.
        assert [len(pad_runs(r.prompt_token_ids)) for r in (r1, r2)] == [4, 5]

        # The staged requests hold references, the store each image's bytes once.
        order = ["task", "photo", "crop", "task", "plot"]
        digests = {k: hashlib.sha256(data_of(v)).hexdigest() for k, v in images.items()}
        assert attachment_refs(r2.request) == [f"attachment:sha256:{digests[k]}" for k in order]
        with open_store(p.store_url) as store:
            fetched = store.fetch([r1.call_id, r2.call_id])
            store.verify()
        stored = {a.sha256: a for r in fetched for a in r.attachments}
        assert set(stored) == set(digests.values())
        for name, url in images.items():
            attachment = stored[digests[name]]
            assert attachment.data == data_of(url)
            assert attachment.media_type == url[5 : url.index(";")]
        db = sqlite3.connect(tmp_path / "store.db")
        try:
            (rows,) = db.execute("SELECT count(*) FROM attachments").fetchone()
        finally:
            db.close()
        assert rows == len(images)
    finally:
        await stop_proxy(p)


# Token-in over image turns. The random model only reasons, so each tool-call turn is steered as
# tests/e2e/test_vllm.py steers the text model (the VLM's tokenizer puts `</think>` and
# `<|im_end|>` at the same ids): `</think>` first, then a regex of a hermes block.
def steer_tool_call(command: str) -> dict[str, Any]:
    return {**test_vllm.steer_tool_call(command), "max_tokens": 64}


async def play_image_session(p: Proxy, rollout: str, images: dict[str, str]) -> list[Answer]:
    """Three calls as OpenCode makes them: the task (two images) answered by a crop tool call;
    its result and the crop with the task image again (streamed), answered by a plot tool call;
    its result and the plot, answered freely. Each answer is replayed as the agent replays it."""
    messages = image_session(images)[:2]
    answers: list[Answer] = []
    follow_ups = [
        [image(images["crop"]), image(images["task"])],
        [text("The plot:"), image(images["plot"])],
    ]
    steering = [steer_tool_call("python crop.py"), steer_tool_call("python plot.py"), {}]
    for turn, steer in enumerate(steering):
        stream = turn == 1
        request = {**body(messages), "stream": stream, **steer}
        answer = await read_answer(await p.chat(request, rollout=rollout), stream=stream)
        assert answer.status == "staged", (turn, answer)
        answers.append(answer)
        if turn < len(follow_ups):
            assert answer.tool_calls, (turn, answer)
            results = [
                {"role": "tool", "tool_call_id": call["id"], "content": f"wrote {turn}.png"}
                for call in answer.tool_calls
            ]
            user_turn = {"role": "user", "content": follow_ups[turn]}
            messages = [*messages, replayed(answer), *results, user_turn]
    return answers


async def test_token_in_over_image_turns_is_one_segment_with_vllms_placeholders(
    vlm_url: str, tmp_path: Path, images: dict[str, str], control: Any
) -> None:
    p = await start_proxy(tmp_path, upstream=vlm_url, admin_token=control.TOKEN, token_in="on")
    rollout = "vlm-token-in"
    try:
        await play_image_session(p, rollout, images)
        records = p.calls(rollout)
        assert len(records) == 3
        assert all(r.token_in for r in records)
        for r in records:
            # The record's placeholders are the prompt's image pad runs, one per image part.
            media = media_of(r.extras)
            assert media is not None, r.extras
            assert [{"offset": m.offset, "length": m.length} for m in media] == pad_runs(
                r.prompt_token_ids
            )
        assert [len(media_of(r.extras) or ()) for r in records] == [2, 4, 5]
        for prev, r in pairwise(records):
            exact = prev.prompt_token_ids.tolist() + prev.completion_token_ids.tolist()
            prompt = r.prompt_token_ids.tolist()
            assert prompt[: len(exact)] == exact
            assert segment_break_of(r.extras) is None
            # The previous call's images keep their hashes and places.
            assert (media_of(r.extras) or ())[: len(media_of(prev.extras) or ())] == media_of(
                prev.extras
            )
            # After the inserted close of the previous turn, the appended messages are vLLM's
            # own rendering of them, image placeholders expanded as vLLM expands them: the plain
            # render of the same request ends with the same tokens and placeholder lengths.
            inserted = max(end for _, end, _ in r.bridge_spans) if r.bridge_spans else len(exact)
            appended = prompt[inserted:]
            plain = await render(vlm_url, as_forwarded(with_data(r.request, images)))
            assert plain["token_ids"][-len(appended) :] == appended
            shift = len(prompt) - len(plain["token_ids"])
            new_items = [
                {"offset": m["offset"] + shift, "length": m["length"]}
                for m in plain["features"]["mm_placeholders"]["image"]
                if m["offset"] + shift >= inserted
            ]
            assert new_items == pad_runs(prompt)[len(media_of(prev.extras) or ()) :]
            assert len(new_items) == (2 if r is records[1] else 1)

        await control(p.client).seal(rollout)
        with open_store(p.store_url) as store:
            traj = store.trajectory(rollout)
            store.verify()
        assert traj.breaks == []
        assert len(traj.segments) == 1
        last = records[-1]
        assert traj.token_ids.tolist() == (
            last.prompt_token_ids.tolist() + last.completion_token_ids.tolist()
        )
    finally:
        await stop_proxy(p)


async def test_transformers_recomputes_an_image_turns_recorded_logprobs(
    vlm_url: str, tmp_path: Path, images: dict[str, str], vlm_paths: tiny_vlm.Paths
) -> None:
    """The trainer's side: the same tiny model in transformers, with its own image processor,
    given the record's prompt + completion ids and its images (from the store, in prompt order),
    gives the logprobs the record holds (vLLM's raw logprobs, float32 on both sides)."""
    p = await start_proxy(tmp_path, upstream=vlm_url)
    try:
        resp = await p.chat(body(image_session(images), max_tokens=16), rollout="vlm-logprobs")
        assert resp.status == 200, await resp.text()
        await resp.read()
        (staged,) = p.calls("vlm-logprobs")
        with open_store(p.store_url) as store:
            (record,) = store.fetch([staged.call_id])
        by_sha = {a.sha256: a.data for a in record.attachments}
        in_order = [by_sha[ref.rsplit(":", 1)[1]] for ref in attachment_refs(record.request)]
        assert len(in_order) == 5
        result = tiny_vlm.recompute_logprobs(
            vlm_paths,
            record.prompt_token_ids.tolist(),
            record.completion_token_ids.tolist(),
            in_order,
        )
        # The processor expands each image as vLLM did: one pad per merged 2x2 patch.
        lengths = [t * h * w // 4 for t, h, w in result["image_grid_thw"]]
        assert lengths == [run["length"] for run in pad_runs(record.prompt_token_ids)]
        recorded = record.completion_logprobs.tolist()
        assert len(result["logprobs"]) == len(recorded) == 16
        assert max(abs(a - b) for a, b in zip(result["logprobs"], recorded, strict=True)) <= 1e-3
    finally:
        await stop_proxy(p)


def verl_check(vlm_paths: tiny_vlm.Paths, samples: list[dict[str, Any]]) -> list[Any]:
    """tests/support/vlm_trainer_check.py on `samples` in the trainers' venv (built on first
    use): verl's answer per sample."""
    python = trainer_env.prepare().python
    check = [str(python), "-m", "tests.support.vlm_trainer_check", str(vlm_paths.model)]
    proc = subprocess.run(
        check,
        input=json.dumps(jsonable(samples)),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, f"verl's check failed:\n{proc.stderr[-4000:]}"
    answers: list[Any] = json.loads(proc.stdout)
    return answers


async def test_verl_places_the_exported_images_where_the_model_saw_them(
    vlm_url: str, tmp_path: Path, images: dict[str, str], vlm_paths: tiny_vlm.Paths, control: Any
) -> None:
    """The token-in image session exported for verl (`to_verl`): verl's own `AgentLoopOutput`
    takes it, and verl's own M-RoPE placement (`get_rope_index`, in the trainers' venv) of its
    images in its ids equals transformers' (which gives vLLM's logprobs: the test above), image
    by image, the task image sent twice included."""
    p = await start_proxy(tmp_path, upstream=vlm_url, admin_token=control.TOKEN, token_in="on")
    rollout = "vlm-verl"
    try:
        await control(p.client).create(rollout)
        await play_image_session(p, rollout, images)
        await control(p.client).seal(rollout)
        graded = await p.client.put(
            f"/admin/rollouts/{rollout}/outcome", json={"reward": 1.0}, headers=ADMIN
        )
        assert graded.status == 200, await graded.text()
        with open_store(p.store_url) as store:
            (sample,) = to_verl(episodes(store))
    finally:
        await stop_proxy(p)
    output = sample["output"]
    exported = [item["bytes"] for item in output["multi_modal_data"]["images"]]
    order = ["task", "photo", "crop", "task", "plot"]
    assert exported == [data_of(images[k]) for k in order]
    ids = output["prompt_ids"] + output["response_ids"]
    assert len(pad_runs(ids)) == len(exported)

    (verl,) = verl_check(vlm_paths, [sample])
    model = tiny_vlm.recompute_logprobs(
        vlm_paths, output["prompt_ids"], output["response_ids"], exported
    )
    assert verl["image_grid_thw"] == model["image_grid_thw"]
    assert verl["position_ids"] == model["position_ids"]
    # Each placeholder run is placed as its image's grid of merged patches (rows x columns), not
    # as a line of text positions.
    for run, (_, h, w) in zip(pad_runs(ids), verl["image_grid_thw"], strict=True):
        span = slice(run["offset"], run["offset"] + run["length"])
        rows, columns = (sorted(set(verl["position_ids"][axis][span])) for axis in (1, 2))
        assert (len(rows), len(columns)) == (h // 2, w // 2)
        assert len(rows) * len(columns) == run["length"]


async def test_opencode_with_an_image_file_to_the_real_vlm_is_one_token_in_segment(
    vlm_url: str,
    tmp_path: Path,
    control: Any,
    opencode_binary: Path,
    vlm_paths: tiny_vlm.Paths,
) -> None:
    """Real OpenCode 1.18.33, `opencode run --file task.png` with image input declared, through
    the proxy (token-in on) to the real VLM. Steered to finish after one agent call (a regex
    answer, thinking off: the random model would not stop on its own), titled so no title call
    is made: the session's one record carries the image, placed as vLLM places it."""
    (task_png,) = tiny_vlm.make_images(vlm_paths, [("PNG", 120, 90, 7)])
    work = tmp_path / "work"
    work.mkdir()
    (work / "task.png").write_bytes(data_of(task_png))
    p = await start_proxy(tmp_path, upstream=vlm_url, admin_token=control.TOKEN, token_in="on")
    rollout = "vlm-opencode"
    try:
        api = control(p.client)
        created = await api.create(rollout)
        steer = {
            "structured_outputs": {"regex": "Done\\."},
            "chat_template_kwargs": {"enable_thinking": False},
        }
        done = await asyncio.to_thread(
            opencode_env.opencode_run,
            created["base_url"],
            "Fix the layout shown in the image.",
            files=[work / "task.png"],
            title="visual task",
            cwd=work,
            timeout=300,
            image_input=True,
            model_options=steer,
        )
        manifest = await api.seal(rollout)
        assert done.returncode == 0, (done.stderr[-3000:], manifest["calls"])
        assert [c["status"] for c in manifest["calls"]] == ["staged"]
        with open_store(p.store_url) as store:
            (record,) = store.fetch([c["coords"] for c in manifest["calls"]])
            traj = store.trajectory(rollout)
            store.verify()
    finally:
        await stop_proxy(p)
    assert record.token_in
    assert record.response["content"] == "Done."
    digest = hashlib.sha256(data_of(task_png)).hexdigest()
    assert record.attachment_refs() == [digest]
    assert [a.data for a in record.attachments] == [data_of(task_png)]
    # OpenCode's request, its image restored, rendered by vLLM: the record's prompt and
    # placeholders are vLLM's own.
    sent = with_data(record.request, {"task": task_png})
    rendered = await render(vlm_url, as_forwarded(sent))
    assert rendered["token_ids"] == record.prompt_token_ids.tolist()
    (placeholder,) = rendered["features"]["mm_placeholders"]["image"]
    media = media_of(record.extras)
    assert media is not None
    assert [(m.offset, m.length) for m in media] == [(placeholder["offset"], placeholder["length"])]
    assert pad_runs(record.prompt_token_ids) == [
        {"offset": placeholder["offset"], "length": placeholder["length"]}
    ]
    assert len(traj.segments) == 1
    assert traj.breaks == []
