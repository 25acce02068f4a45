"""The sampling an upstream applied: the request's keys over the model's own defaults.

vLLM fills every sampling parameter a request leaves unset (absent or null) from the model's
generation config (``generation_config.json``; ``--generation-config vllm`` turns that off), else
from its own neutral values. The proxy learns those defaults once per upstream process from a
probe render (`capture_proxy.upstream`) and merges them here, locally, per call: no round trip.
How vLLM resolves them is described in docs/upstream-facts.md ("Sampling defaults").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["RESOLVED_SAMPLING_KEYS", "changes_distribution", "effective_sampling"]

#: The sampling parameters an upstream resolves from its defaults when a request leaves them
#: unset: the ones a generation config can set, and the penalties that also shape the
#: distribution sampled from.
RESOLVED_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)

#: Below this temperature vLLM samples greedily and ignores top_p, top_k and min_p.
_GREEDY_BELOW = 1e-5


def effective_sampling(
    sampling: Mapping[str, Any], defaults: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The sampling the upstream applied to a request whose forwarded sampling keys are
    `sampling`, given the `defaults` it fills in (None: unknown, and so is the result).

    A key the request set (not null) wins; an unset resolved key takes the default. With a
    greedy temperature, vLLM resets top_p, top_k and min_p to their neutral values.
    """
    if defaults is None:
        return None
    out = {k: v for k, v in defaults.items() if k in RESOLVED_SAMPLING_KEYS}
    out.update((k, v) for k, v in sampling.items() if v is not None)
    temperature = out.get("temperature")
    if isinstance(temperature, int | float) and temperature < _GREEDY_BELOW:
        out.update(top_p=1.0, top_k=0, min_p=0.0)
    return out


def changes_distribution(sampling: Mapping[str, Any]) -> list[str]:
    """The effective sampling values that make the sampled distribution differ from the
    model's raw one (so raw logprobs are not those of the tokens' distribution), as
    ``key=value`` strings; empty when none does."""
    neutral = {
        "temperature": 1.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    out = [
        f"{k}={sampling[k]}"
        for k, v in neutral.items()
        if isinstance(sampling.get(k), int | float) and sampling[k] != v
    ]
    top_k = sampling.get("top_k")
    if isinstance(top_k, int) and top_k > 0:
        out.append(f"top_k={top_k}")
    if sampling.get("logit_bias"):
        out.append("logit_bias")
    return out
