"""The trainer: recompute the batch's logprobs with `transformers`, check them, take one GRPO step.

Run with an interpreter that has torch and transformers (the CI uses the tiny vLLM's venv, see
scripts/tiny_vllm.py); it imports nothing from capture-proxy, only reads the batch file that
`batch.take_batch` wrote::

    python examples/rl_loop/trainer.py BATCH.json --weights DIR --out DIR [--lr 3e-3]
    python examples/rl_loop/trainer.py BATCH.json --weights DIR --check-only [--other DIR]

It prints one JSON line: the largest absolute difference between the recorded logprobs and the
recomputed ones (``max_abs_diff``), the tokens checked and trained (tokens sampled under a
grammar, ``tokens_guided``, are neither), the loss, and with ``--other`` the difference against
another set of weights (to show an update took).

What it recomputes is vLLM's ``processed_logprobs``: the model's logits with the call's
``logit_bias``, divided by its temperature, cut to its top-k and top-p the way vLLM's sampler
does (vllm/v1/sample/ops/topk_topp_sampler.py), then log-softmaxed. Other sampling that changes
the distribution (penalties, min_p) and other logprobs modes are refused: the check would not
be meaningful.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from transformers import AutoModelForCausalLM  # type: ignore[import-not-found, unused-ignore]

#: Below this temperature vLLM samples greedily: no temperature, top-k or top-p is applied.
GREEDY_BELOW = 1e-5
NEUTRAL = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def processed_logprobs(logits: Any, sampling: dict[str, Any]) -> Any:
    """vLLM's processed logprobs for `logits` (positions x vocab, float32) under `sampling`."""
    mode = sampling.get("logprobs_mode")
    if mode != "processed_logprobs":
        raise SystemExit(f"logprobs mode {mode!r}: only processed_logprobs is recomputed here")
    for key, neutral in NEUTRAL.items():
        if sampling.get(key, neutral) not in (neutral, None):
            raise SystemExit(f"sampling {key}={sampling[key]} is not reproduced by this trainer")
    logits = logits.float()
    bias = sampling.get("logit_bias") or {}
    if bias:
        logits = logits.clone()
        for token, value in bias.items():
            logits[:, int(token)] += max(-100.0, min(100.0, float(value)))
    temperature = float(sampling.get("temperature", 1.0))
    if temperature < GREEDY_BELOW:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / temperature
    top_k = int(sampling.get("top_k") or 0)
    top_p = float(sampling.get("top_p") or 1.0)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab or top_p < 1.0:
        ordered, index = logits.sort(dim=-1, descending=False)
        if 0 < top_k < vocab:
            kth = ordered[:, vocab - top_k].unsqueeze(1)
            ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        if top_p < 1.0:
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            cut = cumulative <= 1 - top_p
            cut[:, -1] = False  # at least one token stays
            ordered = ordered.masked_fill(cut, float("-inf"))
        logits = torch.empty_like(logits).scatter(-1, index, ordered)
    return torch.log_softmax(logits, dim=-1)


def guided(sample: dict[str, Any], t: int) -> bool:
    """Whether token `t` was sampled under a grammar (structured outputs): its logprob is the
    grammar-masked one, which the model alone does not give. Neither checked nor trained on."""
    return bool(sample["samplings"][sample["call_index"][t]].get("guided"))


def sampled_logprobs(model: Any, sample: dict[str, Any]) -> tuple[Any, Any]:
    """The recomputed logprob of every sampled token of `sample` (with gradient), and the
    recorded ones, in token order; tokens sampled under a grammar are left out."""
    ids, mask, calls = sample["token_ids"], sample["loss_mask"], sample["call_index"]
    recomputed, recorded = [], []
    for start, end in sample["segments"]:
        positions = [t for t in range(start + 1, end) if mask[t] and not guided(sample, t)]
        if not positions:
            continue
        hidden = model.model(input_ids=torch.tensor([ids[start:end]])).last_hidden_state[0]
        # The logits that predicted token t are at t - 1; only those positions are projected.
        logits = model.lm_head(hidden[[t - 1 - start for t in positions]])
        by_call: dict[int, list[int]] = defaultdict(list)
        for row, t in enumerate(positions):
            by_call[calls[t]].append(row)
        out = torch.empty(len(positions))
        for call, rows in by_call.items():
            lp = processed_logprobs(logits[rows], sample["samplings"][call])
            chosen = torch.tensor([ids[positions[r]] for r in rows])
            out = out.index_put((torch.tensor(rows),), lp.gather(1, chosen[:, None])[:, 0])
        recomputed.append(out)
        recorded.append(torch.tensor([sample["logprobs"][t] for t in positions]))
    if not recomputed:
        return torch.empty(0), torch.empty(0)
    return torch.cat(recomputed), torch.cat(recorded)


def _free_tokens(sample: dict[str, Any]) -> int:
    """The sampled tokens of `sample` that were not sampled under a grammar."""
    mask = sample["loss_mask"]
    return sum(1 for t in range(len(mask)) if mask[t] and not guided(sample, t))


def grpo_advantages(samples: list[dict[str, Any]]) -> list[float]:
    """Each rollout's reward minus its group's mean, over the group's standard deviation."""
    groups: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        groups[s["group_id"]].append(float(s["reward"]))
    out = []
    for s in samples:
        rewards = torch.tensor(groups[s["group_id"]])
        std = rewards.std(unbiased=False) if len(rewards) > 1 else torch.tensor(0.0)
        out.append(float((s["reward"] - rewards.mean()) / (std + 1e-6)))
    return out


def load(weights: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("batch", type=Path)
    parser.add_argument("--weights", type=Path, required=True, help="the policy's HF folder")
    parser.add_argument("--out", type=Path, help="where to write the updated weights")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--check-only", action="store_true", help="no training step")
    parser.add_argument("--other", type=Path, help="also compare with these weights")
    args = parser.parse_args(argv)
    samples: list[dict[str, Any]] = json.loads(args.batch.read_text())["samples"]
    torch.manual_seed(0)
    model = load(args.weights)
    report: dict[str, Any] = {"rollouts": len(samples)}

    with torch.no_grad():
        pairs = [sampled_logprobs(model, s) for s in samples]
    diffs = torch.cat([(a - b).abs() for a, b in pairs])
    report["tokens_checked"] = int(diffs.numel())
    report["tokens_guided"] = sum(sum(s["loss_mask"]) - _free_tokens(s) for s in samples)
    report["max_abs_diff"] = float(diffs.max()) if diffs.numel() else None
    if args.other is not None:
        other = load(args.other)
        with torch.no_grad():
            pairs = [sampled_logprobs(other, s) for s in samples]
        other_diffs = torch.cat([(a - b).abs() for a, b in pairs])
        finite = other_diffs[other_diffs.isfinite()]
        report["other_max_abs_diff"] = float(finite.max()) if finite.numel() else None
        # A token outside the other weights' top-p nucleus has logprob -inf under them.
        report["other_outside_nucleus"] = int((~other_diffs.isfinite()).sum())

    if not args.check_only:
        if args.out is None:
            parser.error("--out is needed to train")
        # vLLM 0.32's in-place reload cannot update a tied lm_head: it keeps its old tensor
        # while the embedding takes the new one (observed; "ParallelLMHead: Failed to load
        # weights"). The tiny model ties them, so the embedding is frozen.
        trained = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
        for n, p in model.named_parameters():
            p.requires_grad_("embed_tokens" not in n)
        optimizer = torch.optim.Adam(trained, lr=args.lr)
        model.train()
        advantages = grpo_advantages(samples)
        # A rollout with no advantage (alone in its group, or as good as its group's mean)
        # adds nothing to the gradient: it is not run through the model again.
        used = [(s, a) for s, a in zip(samples, advantages, strict=True) if a != 0.0]
        if not used:
            raise SystemExit("no rollout has an advantage (equal rewards in every group)")
        tokens = sum(_free_tokens(s) for s, _ in used)
        loss = torch.zeros(())
        for sample, advantage in used:
            logprobs, _ = sampled_logprobs(model, sample)
            # REINFORCE with the group baseline: raise the logprobs of the sampled tokens of
            # rollouts better than their group, lower the others'; mean over all trained tokens.
            loss = loss - advantage * logprobs.sum() / tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.eval()
        args.out.mkdir(parents=True)
        model.save_pretrained(str(args.out), safe_serialization=True)
        for f in args.weights.iterdir():  # the tokenizer and template: a complete model folder
            if f.is_file() and not (args.out / f.name).exists():
                shutil.copy2(f, args.out / f.name)
        report.update(loss=float(loss), tokens_trained=tokens, advantages=advantages)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
