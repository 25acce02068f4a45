"""The tiny VLM's cached environment (scripts/tiny_vlm.py), without building it: a venv and a
model are trusted only when their markers record this recipe, and its template renders every
image part as Qwen's vision markup. The real server's checks are tests/e2e/test_vlm.py."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import tiny_vllm, tiny_vlm
from scripts.cached_env import read_marker


def test_a_venv_and_model_are_reused_only_when_their_markers_record_this_recipe(
    tmp_path: Path,
) -> None:
    paths = tiny_vlm.Paths(tmp_path)
    assert paths.root == tmp_path / "tiny-vlm"  # its own folder: the text model's is untouched
    assert paths.root != tiny_vllm.Paths(tmp_path).root
    paths.venv.mkdir(parents=True)
    paths.model.mkdir(parents=True)
    assert read_marker(paths.marker) is None  # an interrupted install: rebuilt
    paths.marker.write_text(json.dumps({**tiny_vlm._venv_recipe(), "recipe": 0}))
    assert read_marker(paths.marker) != tiny_vlm._venv_recipe()
    paths.marker.write_text(json.dumps(tiny_vlm._venv_recipe()))
    (paths.model / "capture-proxy-model.json").write_text(json.dumps(tiny_vlm.MODEL_RECIPE))
    # Both markers of this recipe: prepare() returns at once, installing nothing.
    assert tiny_vlm.prepare(tmp_path).model == paths.model


def test_the_template_writes_image_parts_as_vision_markup_else_is_the_text_models() -> None:
    template = tiny_vlm.CHAT_TEMPLATE
    assert template.count(tiny_vlm.IMAGE_MARKUP) == 1  # in the one macro every role's text uses
    assert "p.type in ('image', 'image_url')" in template
    # The rest is the text model's template: the same tools, reasoning and tool-call rendering.
    assert template.replace(tiny_vlm._PARTS, tiny_vlm._TEXT_PART) == tiny_vllm.CHAT_TEMPLATE
    assert tiny_vlm.IMAGE_PAD_ID == 11
