"""verl's own code on a VLM rollout's export: where verl places each image of a sample.

Runs inside the trainers' venv (scripts/trainer_env.py: verl 0.9.1, transformers 5.8, no
torchvision), never the project's; started from the repository root as

    <trainers venv>/bin/python -m tests.support.vlm_trainer_check MODEL_DIR  < samples.json

with the samples of `capture_proxy.read.trainers.to_verl` (bytes as ``{"__bytes__": base64}``).
For each sample: ``AgentLoopOutput(**output)`` (verl's class), its images decoded with PIL, the
model folder's image processor (transformers' own, PIL backend) for their ``image_grid_thw``, and
verl's ``get_rope_index`` (verl/models/transformers/qwen2_vl.py), which finds each image's
placeholder run in ``prompt_ids + response_ids`` and gives the sequence's M-RoPE positions.
verl's ``get_rope_index`` reads only ``image_processor.merge_size`` and the tokenizer's image
token ids from its processor argument: the full Qwen2.5-VL processor needs torchvision, absent
here, so the two parts are passed as the processor. Answers, on stdout, one JSON object per
sample: ``{"image_grid_thw", "position_ids"}``.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.support.trainer_check import _unbytes


def check(model_dir: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    from verl.models.transformers.qwen2_vl import get_rope_index

    # transformers 5.8 builds no image processor by its Auto class without torchvision: its PIL
    # one, with the model folder's settings (pixel bounds, patch and merge sizes).
    settings = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    keys = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
    image_processor = Qwen2VLImageProcessorPil(**{k: settings[k] for k in keys})
    processor = SimpleNamespace(
        image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(model_dir)
    )
    answers = []
    for sample in samples:
        fields = dict(sample["output"])
        data = fields["multi_modal_data"]
        images = [Image.open(io.BytesIO(i["bytes"])).convert("RGB") for i in data["images"]]
        output = AgentLoopOutput(**{**fields, "multi_modal_data": {**data, "images": images}})
        grid = image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        ids = torch.tensor(output.prompt_ids + output.response_ids)
        positions = get_rope_index(processor, ids, image_grid_thw=grid)
        answers.append({"image_grid_thw": grid.tolist(), "position_ids": positions.tolist()})
    return answers


def main() -> int:
    json.dump(check(sys.argv[1], _unbytes(json.load(sys.stdin))), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
