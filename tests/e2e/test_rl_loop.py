"""The RL loop closed on CPU: examples/rl_loop against a real vLLM 0.32 and real OpenCode.

`-m vllm` and `-m e2e`. A vLLM serving a copy of the tiny model with processed logprobs (the
`vllm_trainable` fixture), the real proxy (``capture-proxy serve``, a subprocess), the scripted
agent in two GRPO groups of two rollouts plus one OpenCode session per step, all token-in. Each
step's trainer recomputes the recorded logprobs with `transformers` (≤ 1e-3), trains, and vLLM
reloads the new weights under the proxy's pause; the next step's tokens carry the new version
and match the new weights, not the old ones.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capture_proxy import open_store
from examples.rl_loop.loop import MATCH_TOLERANCE, LoopConfig, run_loop
from scripts import opencode_env, tiny_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

ADMIN_TOKEN = "rl-loop-admin-token-0123456789"
# Ids of the tiny tokenizer: `</think>` ends the reasoning the random model always starts, and
# `<|im_end|>` must beat `<|endoftext|>` once the call is written (as in test_vllm.py).
THINK_END, IM_END = "4", "2"


def steer_tool_call(command: str) -> dict[str, Any]:
    """The request keys that make the tiny model call `bash` with `command`: a hermes block
    as a regex (vLLM applies structured outputs once reasoning has ended)."""
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    literal = re.sub(r"([.{}()\[\]*+?|^$\\])", r"\\\1", call)
    return {
        "logit_bias": {THINK_END: 100, IM_END: 50},
        "structured_outputs": {"regex": f"<tool_call>\n{literal}\n</tool_call>"},
        "max_tokens": 64,
    }


@contextlib.contextmanager
def serve_proxy(upstream: str, store_url: str, tmp_path: Path) -> Iterator[str]:
    """``capture-proxy serve`` in front of `upstream` with the control API; its URL."""
    token_file = tmp_path / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    port = tiny_vllm.free_port()
    log = (tmp_path / "proxy.log").open("wb")
    argv = [sys.executable, "-m", "capture_proxy", "serve", "--upstream", upstream]
    argv += ["--store", store_url, "--port", str(port), "--admin-token-file", str(token_file)]
    argv += ["--upstream-logprobs-mode", "processed_logprobs"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{url}/readyz", timeout=5) as resp,
            ):
                if resp.status == 200:
                    break
            assert proc.poll() is None, (tmp_path / "proxy.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "proxy.log").read_text()[-3000:]
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def opencode_agent(work: Path) -> Any:
    """OpenCode 1.18.33 as the loop's external agent: one session in `work`, unsteered (its own
    prompt and tools, short answers); the text it showed, for the grader."""

    def play(base_url: str, api_key: str) -> str:
        done = opencode_env.opencode_run(
            base_url,
            "list the files",
            cwd=work,
            timeout=240,
            image_input=False,
            output_limit=16,
            model_options={"temperature": 0.9, "top_p": 0.95},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        events = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        return "".join(e["part"].get("text", "") for e in events if "part" in e)

    return play


def test_rl_loop_trains_on_checked_logprobs_and_the_next_rollouts_carry_the_new_weights(
    vllm_trainable: tuple[str, Path], tmp_path: Path, opencode_binary: Path
) -> None:
    vllm_url, weights_root = vllm_trainable
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    work = tmp_path / "work"
    work.mkdir()
    (work / "main.py").write_text("print('hello')\n")
    lines: list[str] = []
    with serve_proxy(vllm_url, store_url, tmp_path) as proxy_url:
        cfg = LoopConfig(
            proxy_url,
            ADMIN_TOKEN,
            vllm_url,
            store_url,
            weights_root,
            str(tiny_vllm.prepare().python),
            external={"opencode": opencode_agent(work)},
            steer=steer_tool_call,
            log=lines.append,
        )
        reports = run_loop(cfg)
    sys.stderr.write("\n" + "\n".join(f"[rl-loop] {line}" for line in lines) + "\n")
    assert [r.step for r in reports] == [0, 1]
    for r in reports:
        assert r.max_abs_diff <= MATCH_TOLERANCE
        assert r.rollouts == 5  # two groups of two, and OpenCode's
        assert r.version_spans == [(r.step, str(r.step))]
        assert r.tool_calls == 4  # one per scripted rollout, a tool result sent back for each
        assert r.tokens_guided > 0
        # OpenCode's rollout, alone in its group, has no advantage: checked, not trained on.
        assert 0 < r.tokens_trained < r.tokens_checked
    # Step 1's tokens were sampled by v1: v0 gives other logprobs for them.
    assert reports[1].previous_weights_diff is not None
    assert reports[1].previous_weights_diff > 100 * MATCH_TOLERANCE
    with open_store(store_url) as store:
        store.verify()
        opencode = store.trajectory("s1-opencode")
        scripted = [
            store.trajectory(f"s{s}-g{g}-{i}") for s in (0, 1) for g in (0, 1) for i in (0, 1)
        ]
    # Token-in: each scripted session (tool call, tool result, answer) is one sequence.
    assert [(len(t.segments), t.breaks) for t in scripted] == [(1, [])] * 8
    assert all(len(t.calls) == 2 for t in scripted)
    assert len(opencode.token_ids) > 10_000  # OpenCode's own prompt and tools
    assert set(opencode.engine_weight_versions) - {None} == {"1"}
