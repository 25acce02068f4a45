"""Generate's request without the request's own render (`capture_proxy.core.token_in._beside`):
what is kept of a render, the limit worked out for another prompt, and the check."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from capture_proxy.adapters.vllm import encode_ids, read_render
from capture_proxy.core.token_in._beside import (
    GenerateTemplates,
    early_body,
    mismatch,
    template_key,
)

RENDER = Path(__file__).parents[2] / "fixtures/vllm-0.32.0/token-in/render-chat-response.json"


def answer(**change: object) -> bytes:
    """A real render answer (vLLM 0.32), with `change` to its fields."""
    raw = orjson.loads(RENDER.read_bytes())
    raw.update(change)
    return orjson.dumps(raw)


def test_the_key_is_the_request_without_its_messages() -> None:
    a = {"model": "m", "messages": [{"role": "user", "content": "a"}], "temperature": 0}
    b = {"temperature": 0, "model": "m", "messages": []}
    assert template_key(a) == template_key(b)
    assert template_key(a) != template_key({**a, "temperature": 1})


def test_a_render_with_images_or_a_structured_output_leaves_no_template_and_refuses_nothing() -> (
    None
):
    templates = GenerateTemplates()
    rendered = read_render(answer())
    templates.put("k", rendered)
    assert templates.get("k") is not None
    sampling = {**rendered.sampling_params, "structured_outputs": {"json": {}}}
    templates.put("k", read_render(answer(sampling_params=sampling)))
    assert templates.get("k") is None
    templates.put("k", rendered)  # not refused: kept again
    assert templates.get("k") is not None
    templates.refuse("k")
    templates.put("k", rendered)
    assert templates.get("k") is None


@pytest.mark.parametrize("grown", [0, 5, 40])
def test_without_a_limit_the_room_is_the_one_the_prompt_leaves(grown: int) -> None:
    sampling = orjson.loads(answer())["sampling_params"]
    rendered = read_render(answer(sampling_params={**sampling, "max_tokens": 30000}))
    templates = GenerateTemplates()
    templates.put("k", rendered)
    template = templates.get("k")
    assert template is not None
    length = len(rendered.prompt_ids) + grown
    ids = encode_ids(list(range(length)))
    body = orjson.loads(early_body(template, {}, length, ids, stream=False))
    room = rendered.resolved_sampling["max_tokens"] + len(rendered.prompt_ids)
    assert body["sampling_params"]["max_tokens"] == room - length
    assert body["request_id"].startswith("chatcmpl-")
    assert body["request_id"] != orjson.loads(answer())["request_id"]  # fresh, vLLM's form
    # The ordinary request for a prompt of that length, from a render that resolved it.
    ordinary = rendered.generate_body(
        list(range(length)),
        sampling_params={**rendered.resolved_sampling, "max_tokens": room - length},
        ids_json=ids,
    )
    assert mismatch(early_body(template, {}, length, ids, stream=False), ordinary, ids) is None


def test_the_check_names_what_differs() -> None:
    rendered = read_render(answer())
    templates = GenerateTemplates()
    templates.put("k", rendered)
    template = templates.get("k")
    assert template is not None
    n = len(rendered.prompt_ids)
    ids = encode_ids(rendered.prompt_ids)
    early = early_body(template, {"max_tokens": 7}, n, ids, stream=False)
    params = rendered.resolved_sampling

    def ordinary(**sampling: object) -> bytes:
        return rendered.generate_body(sampling_params={**params, **sampling}, ids_json=ids)

    assert mismatch(early, ordinary(), ids) is None
    assert mismatch(early, ordinary(max_tokens=params["max_tokens"] - 1), ids) == "max_tokens"
    assert mismatch(early, ordinary(top_k=5), ids) == "sampling"
    assert mismatch(early, ordinary(), encode_ids([1, 2])) == "prompt"
    other = read_render(answer(model="another"))
    body = other.generate_body(sampling_params=params, ids_json=ids)
    assert mismatch(early, body, ids) == "request"
