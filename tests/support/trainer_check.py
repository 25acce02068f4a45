"""Run the trainers' own classes and validators on what our adapters produced.

Runs inside the trainers' venv (scripts/trainer_env.py), never the project's: it imports verl and
SkyRL, and nothing of ``capture_proxy``. The tests start it as

    <trainers venv>/bin/python -m tests.support.trainer_check  < checks.json

from the repository root. The input is a JSON list of ``{"check": NAME, "payload": ...}`` (bytes
as ``{"__bytes__": base64}``), run in one process (importing a trainer costs seconds); the
answer, on stdout, is a JSON list with one ``{"ok": answer}`` or ``{"refused": message}`` per
check: the message is the trainer's own exception, its type and text.

Checks:
- ``verl``: every sample's ``output`` through ``AgentLoopOutput(**output)`` (with its
  ``AgentLoopMetrics``) and ``as_dict()``; images decoded from ``{"bytes": ...}`` with PIL and
  given to a Qwen2-VL image processor;
  then each session's final output (verl 0.9.1's multi-output rule, ``{uid}_{session}_{index}``)
  into a ``DataProto`` with ``non_tensor_batch["uid"]`` and ``compute_grpo_outcome_advantage``.
- ``skyrl``: ``validate_generator_output`` (step-wise when asked), with ``trajectory_ids`` made
  into ``TrajectoryID``; then SkyRL's overlong filter on the loss masks and stop reasons.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from collections.abc import Callable
from typing import Any

#: The trainers' modules the checks import.
MODULES = (
    "skyrl.train.generators.base",
    "skyrl.train.utils.trainer_utils",
    "verl.experimental.agent_loop.agent_loop",
    "verl.protocol",
    "verl.trainer.ppo.core_algos",
)


def import_trainers() -> None:
    """Import every trainer module the checks use (the venv's smoke test)."""
    import importlib

    _skyrl_on_311()
    for name in MODULES:
        importlib.import_module(name)


def _skyrl_on_311() -> None:
    # skyrl 0.3.0 says Requires-Python >=3.11, but skyrl/tinker/types.py puts a `typing.TypedDict`
    # into a pydantic model, which pydantic 2 refuses below Python 3.12 ("Please use
    # `typing_extensions.TypedDict`"). Every `skyrl.train` import passes through it. The
    # validators themselves are untouched; this only makes the package importable on 3.11.
    import typing

    import typing_extensions

    if sys.version_info < (3, 12):
        typing.TypedDict = typing_extensions.TypedDict


def _unbytes(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return {k: _unbytes(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unbytes(v) for v in value]
    return value


def check_verl(samples: list[dict[str, Any]]) -> dict[str, Any]:
    import numpy as np
    import torch
    from PIL import Image
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    outputs = []
    images: list[list[int]] = []
    grids: list[list[list[int]]] = []
    for sample in samples:
        fields = dict(sample["output"])
        data = fields.get("multi_modal_data")
        if data is not None:
            # What the trainer side does with our `{"bytes": ...}` items (verl's own
            # `process_image` opens the bytes with PIL the same way before resizing; it needs
            # qwen_vl_utils and torchvision, which do not import beside the CPU torch).
            decoded = [Image.open(io.BytesIO(i["bytes"])).convert("RGB") for i in data["images"]]
            images.append([im.size[0] * im.size[1] for im in decoded])
            grids.append(_vision_grid(decoded))
            fields["multi_modal_data"] = {**data, "images": decoded}
        output = AgentLoopOutput(**fields)
        assert isinstance(output.metrics, AgentLoopMetrics)
        outputs.append(output)
    tensors = [o.as_dict() for o in outputs]
    # verl 0.9.1 (trainer/ppo/v1/utils.py, compute_advantage_for_multi_trajectories): only the
    # final output of each `{uid}_{session_id}` session takes part in GRPO.
    final: dict[str, tuple[int, int]] = {}
    for row, sample in enumerate(samples):
        uid, session, index = sample["key"].rsplit("_", 2)
        session_key = f"{uid}_{session}"
        if session_key not in final or final[session_key][0] < int(index):
            final[session_key] = (int(index), row)
    rows = [row for _, row in final.values()]
    width = max(len(tensors[r]["response_mask"]) for r in rows)
    rewards = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        n = len(tensors[r]["response_mask"])
        rewards[i, :n] = tensors[r]["rm_scores"]
        mask[i, :n] = tensors[r]["response_mask"]
    uids = np.array([samples[r]["uid"] for r in rows], dtype=object)
    # The batch as verl's trainer holds it: tensors, and the GRPO groups in non_tensor_batch.
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": uids}
    )
    advantages, _ = compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"],
        data.batch["response_mask"],
        data.non_tensor_batch["uid"],
    )
    return {
        "n_outputs": len(outputs),
        "scored": [("rm_scores" in t) for t in tensors],
        "final_keys": [samples[r]["key"] for r in rows],
        "final_scores": [float(rewards[i].sum()) for i in range(len(rows))],
        "advantages": [float(advantages[i][mask[i] > 0][0]) for i in range(len(rows))],
        "image_pixels": images,
        "image_grids": grids,
    }


def _vision_grid(images: list[Any]) -> list[list[int]]:
    """The images through a Qwen2-VL image processor, as verl's processor call does with
    `multi_modal_data["images"]` (built locally, no hub; its PIL backend: torchvision does not
    import here): their `image_grid_thw`."""
    from transformers import Qwen2VLImageProcessorPil

    grid: list[list[int]] = Qwen2VLImageProcessorPil()(images=images, return_tensors="pt")[
        "image_grid_thw"
    ].tolist()
    return grid


def check_skyrl(payload: dict[str, Any]) -> dict[str, Any]:
    _skyrl_on_311()
    from skyrl.train.generators.base import TrajectoryID
    from skyrl.train.generators.utils import apply_overlong_filtering
    from skyrl.train.utils.trainer_utils import validate_generator_output

    output = dict(payload["output"])
    if output.get("trajectory_ids") is not None:
        output["trajectory_ids"] = [TrajectoryID(*pair) for pair in output["trajectory_ids"]]
    validate_generator_output(payload["num_prompts"], output, step_wise=payload["step_wise"])
    # SkyRL's overlong filter (generator.apply_overlong_filtering): which rows it would drop.
    kept = apply_overlong_filtering(output["loss_masks"], output["stop_reasons"])
    return {
        "n_rows": len(output["response_ids"]),
        "trajectory_ids": [t.to_string() for t in output.get("trajectory_ids") or []],
        "overlong_dropped": [sum(m) == 0 for m in kept],
    }


CHECKS: dict[str, Callable[[Any], dict[str, Any]]] = {"verl": check_verl, "skyrl": check_skyrl}


def main() -> int:
    answers: list[dict[str, Any]] = []
    for item in json.load(sys.stdin):
        try:
            answers.append({"ok": CHECKS[item["check"]](_unbytes(item["payload"]))})
        except Exception as exc:  # the trainer's own refusal, as the tests show it
            answers.append({"refused": f"{type(exc).__name__}: {exc}".replace("\n", " ")})
    json.dump(answers, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
