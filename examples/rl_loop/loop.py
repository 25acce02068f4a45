"""The loop: rollouts → grades → a batch → a checked training step → new weights in vLLM → again.

`run_loop` drives it against a running proxy (with the control API) in front of a vLLM started
with ``--logprobs-mode processed_logprobs`` and ``VLLM_SERVER_DEV_MODE=1`` on a model folder the
loop may write beside (`LoopConfig.weights_root`/``v0``). Each step N:

1. creates the step's rollouts token-in (``POST /admin/rollouts {"token_in": true}``), runs the
   scripted agent in each (and `LoopConfig.external` agents, such as OpenCode), seals them and
   grades them (``PUT .../outcome`` with the reward and the GRPO group);
2. takes the step's rollouts from the store's batch API (`batch.take_batch`: sealed, graded,
   clean, verified, each once; acknowledged after the training step) and checks every sampled
   token is stamped with version N, by the proxy and by the engine;
3. runs the trainer (`trainer.py`, in an interpreter with torch): it recomputes the sampled
   tokens' processed logprobs with ``transformers`` and checks them against the recorded ones,
   then takes one GRPO step and writes ``v{N+1}``;
4. pauses the proxy, has vLLM reload ``v{N+1}``, and resumes with ``weight_version`` N+1.

Step N+1's check then shows the update took: its tokens match ``v{N+1}`` and not ``v{N}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import agent
from .batch import Batch, take_batch
from .driver import ControlAPI, reload_vllm_weights

__all__ = ["MATCH_TOLERANCE", "LoopConfig", "StepReport", "grade", "run_loop"]

#: The largest difference between recorded and recomputed logprobs the loop accepts (float32).
MATCH_TOLERANCE = 1e-3
#: Against the previous weights the difference must be at least this: the update took.
UPDATE_VISIBLE = 1e-2
TRAINER = Path(__file__).resolve().parent / "trainer.py"
TASKS = ("List the files here.", "How many lines has main.py?")

#: An agent other than the scripted one: called with a rollout's (base_url, api_key), it works
#: the task and returns the text the grader judges. Run in a thread beside the scripted agents.
ExternalAgent = Callable[[str, str], str]


@dataclass
class LoopConfig:
    proxy_url: str
    admin_token: str
    vllm_url: str
    #: The store the proxy writes (a URL ``open_store`` takes: the file, or the proxy itself).
    store_url: str
    #: Holds ``v0`` (the model vLLM serves at the start); the loop writes ``v1``, ``v2``, ...
    weights_root: Path
    #: An interpreter with torch and transformers, for `trainer.py`.
    trainer_python: str
    steps: int = 2
    groups: int = 2
    group_size: int = 2
    turns: int = 2
    sampling: dict[str, Any] = field(
        default_factory=lambda: {"temperature": 0.9, "top_p": 0.95, "max_tokens": 12}
    )
    #: Agents run once per step, each in a group of its own (GRPO gives a lone rollout no
    #: advantage: its tokens are checked, not trained on).
    external: dict[str, ExternalAgent] = field(default_factory=dict)
    #: Extra request keys that make the model call the tool with a command (see `agent.play`);
    #: None: the agent never asks (a real policy calls tools on its own).
    steer: Callable[[str], dict[str, Any]] | None = None
    lr: float = 3e-3
    log: Callable[[str], None] = print


@dataclass
class StepReport:
    """What one step measured."""

    step: int
    rollouts: int
    #: Largest |recorded − recomputed| logprob over every sampled token of the step's batch.
    max_abs_diff: float
    tokens_checked: int
    tokens_trained: int
    #: Sampled tokens of guided (steered) turns: neither checked nor trained on.
    tokens_guided: int
    #: Tool calls the scripted agents' models made.
    tool_calls: int
    #: The same against the previous weights (None at step 0): large when the update took.
    previous_weights_diff: float | None
    #: Sampled tokens the previous weights would not have sampled (outside their top-p).
    previous_weights_outside: int | None
    #: The distinct (driver version, engine version) pairs on the batch's sampled tokens.
    version_spans: list[tuple[int, str | None]]
    #: Wall time of the step's phases: rollouts, read, train, reload.
    seconds: dict[str, float]


def grade(text: str) -> float:
    """A toy verifiable reward: the share of vowels among the letters of the agent's replies.
    Any function of the transcript works; this one varies between rollouts of one task."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def _versions(batch: Batch, version: int) -> list[tuple[int, str | None]]:
    """The (driver, engine) versions on the batch's sampled tokens; raise unless all are N."""
    seen = {
        (s.weight_versions[t], s.engine_weight_versions[t])
        for s in batch.samples
        for t, m in enumerate(s.loss_mask)
        if m
    }
    if seen != {(version, str(version))}:
        raise AssertionError(f"step {version}: sampled tokens stamped {sorted(seen, key=str)}")
    return sorted(seen, key=str)


def _train(cfg: LoopConfig, batch_file: Path, step: int) -> dict[str, Any]:
    weights = cfg.weights_root / f"v{step}"
    cmd = [cfg.trainer_python, str(TRAINER), str(batch_file), "--weights", str(weights)]
    cmd += ["--out", str(cfg.weights_root / f"v{step + 1}"), "--lr", str(cfg.lr)]
    if step > 0:
        cmd += ["--other", str(cfg.weights_root / f"v{step - 1}")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"trainer failed ({done.returncode}):\n{done.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def _rollouts(cfg: LoopConfig, api: ControlAPI, step: int) -> tuple[list[str], int]:
    """Run the step's rollouts, seal and grade them; their ids, and how many tool calls the
    scripted agents made."""
    texts: dict[str, str] = {}
    groups: dict[str, str] = {}
    tool_calls = 0

    def external(play: ExternalAgent, rollout: str) -> str:
        created = api.create_rollout(rollout)
        return play(created["base_url"], created.get("api_key") or "")

    # The external agents (OpenCode: seconds per call on CPU) run beside the scripted ones; the
    # pool's exit waits for them, and `result()` raises what one of them raised.
    with ThreadPoolExecutor(max_workers=max(1, len(cfg.external))) as pool:
        running = {}
        for name, play in cfg.external.items():
            rollout = f"s{step}-{name}"
            groups[rollout] = rollout
            running[rollout] = pool.submit(external, play, rollout)
        for g in range(cfg.groups):
            for i in range(cfg.group_size):
                rollout = f"s{step}-g{g}-{i}"
                created = api.create_rollout(rollout)
                transcript = agent.play(
                    created["base_url"],
                    created.get("api_key") or "",
                    TASKS[g % len(TASKS)],
                    turns=cfg.turns,
                    sampling=cfg.sampling,
                    steer=cfg.steer,
                )
                tool_calls += transcript.tool_calls
                texts[rollout], groups[rollout] = transcript.text, f"s{step}-g{g}"
        for rollout, future in running.items():
            texts[rollout] = future.result()
    for rollout, group in groups.items():
        manifest = api.seal(rollout)
        statuses = {c["status"] for c in manifest["calls"]}
        if statuses != {"staged"}:
            raise AssertionError(f"{rollout}: calls {[c['status'] for c in manifest['calls']]}")
        api.grade(rollout, grade(texts[rollout]), group)
    return sorted(groups), tool_calls


def run_loop(cfg: LoopConfig) -> list[StepReport]:
    """Run `cfg.steps` steps of the loop; each step's figures (also logged as they come)."""
    api = ControlAPI(cfg.proxy_url, cfg.admin_token)
    api.set_weight_version(0)  # vLLM starts without a version: name v0 so tokens carry one
    reports = []
    for step in range(cfg.steps):
        laps = _Laps()
        rollouts, tool_calls = _rollouts(cfg, api, step)
        seconds = {"rollouts": laps.lap()}
        batch, ack = take_batch(cfg.store_url, "rl-loop-trainer", len(rollouts))
        taken = sorted(s.rollout_id for s in batch.samples)
        if taken != rollouts:  # each step's batch is its own rollouts: the last step was acked
            raise AssertionError(f"step {step}: the batch holds {taken}, not {rollouts}")
        spans = _versions(batch, step)
        batch_file = cfg.weights_root / f"batch-{step}.json"
        batch.write(batch_file)
        seconds["read"] = laps.lap()
        trained = _train(cfg, batch_file, step)
        ack()  # used: never delivered to this consumer again
        seconds["train"] = laps.lap()
        api.pause()
        reload_vllm_weights(cfg.vllm_url, str(cfg.weights_root / f"v{step + 1}"))
        api.resume(step + 1)
        seconds["reload"] = laps.lap()
        report = StepReport(
            step=step,
            rollouts=len(batch.samples),
            max_abs_diff=float(trained["max_abs_diff"]),
            tokens_checked=int(trained["tokens_checked"]),
            tokens_trained=int(trained["tokens_trained"]),
            tokens_guided=int(trained["tokens_guided"]),
            tool_calls=tool_calls,
            previous_weights_diff=trained.get("other_max_abs_diff"),
            previous_weights_outside=trained.get("other_outside_nucleus"),
            version_spans=spans,
            seconds=seconds,
        )
        cfg.log(
            f"step {step}: {report.rollouts} rollouts ({tool_calls} tool calls), logprob max "
            f"|recorded - transformers| "
            f"{report.max_abs_diff:.2e} over {report.tokens_checked} tokens"
            + (
                f" (vs the previous weights {report.previous_weights_diff:.2e},"
                f" {report.previous_weights_outside} outside their top-p)"
                if report.previous_weights_diff is not None
                else ""
            )
            + f", trained {report.tokens_trained} tokens ({report.tokens_guided} guided left"
            + f" out), versions {spans}, loaded v{step + 1}"
            + f" (seconds: {seconds})"
        )
        _check(report)
        reports.append(report)
    return reports


class _Laps:
    """Seconds since the previous lap (or since made)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def lap(self) -> float:
        now = time.monotonic()
        seconds, self.last = now - self.last, now
        return round(seconds, 1)


def _check(report: StepReport) -> None:
    if not report.max_abs_diff <= MATCH_TOLERANCE:
        raise AssertionError(f"step {report.step}: logprobs differ by {report.max_abs_diff}")
    previous = report.previous_weights_diff
    if previous is not None and not previous >= UPDATE_VISIBLE:
        raise AssertionError(
            f"step {report.step}: the previous weights give the same logprobs ({previous}):"
            " the update did not take"
        )


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m examples.rl_loop", description=__doc__)
    parser.add_argument("--proxy", required=True, help="the proxy's URL (control API on it)")
    parser.add_argument("--admin-token", required=True)
    parser.add_argument("--vllm", required=True, help="vLLM's URL (dev mode)")
    parser.add_argument("--store", required=True, help="the proxy's store URL")
    parser.add_argument("--weights-root", type=Path, required=True, help="holds v0/")
    parser.add_argument("--trainer-python", default=sys.executable)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    cfg = LoopConfig(
        args.proxy,
        args.admin_token,
        args.vllm,
        args.store,
        args.weights_root,
        args.trainer_python,
        steps=args.steps,
    )
    run_loop(cfg)
    return 0
