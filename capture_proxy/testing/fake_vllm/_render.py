"""The fake vLLM's scale-out render route and RL weight-version routes.

``POST /v1/chat/completions/render`` (vLLM serves it with ``--enable-scale-out``; without, 403
"Scale-out endpoints are disabled") renders a Chat Completions body and answers a
``GenerateRequest``: ``token_ids`` (the prompt), ``sampling_params`` resolved over the model's
generation-config defaults, ``features`` (multimodal; None for text) and
``reasoning_parser_kwargs``. No real render answer was captured into the fixtures yet: this
shape is written from the project's notes of a check on vLLM 0.32's CPU build (the four keys),
and the field list of ``sampling_params`` from vLLM's ``SamplingParams``; re-check it against a
real answer when one is captured. The 403 body's shape was not captured either (FastAPI's
``{"detail": ...}`` is assumed).

``GET /weight_info`` → ``{"weight_version": "..."}`` ("default" at start) and ``POST
/update_weight_version {"new_version": ...}`` are vLLM's dev-mode routes
(``VLLM_SERVER_DEV_MODE=1``); otherwise vLLM does not have them (FastAPI's 404).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._validate import RequestError

__all__ = ["NEUTRAL_SAMPLING", "resolve_sampling", "weight_version_update"]

#: vLLM's own values for the sampling parameters a generation config can set (what a request
#: gets when neither it nor the model's generation config sets them).
NEUTRAL_SAMPLING: Mapping[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}

#: Other sampling parameters a request may set, with vLLM's defaults (not from the model).
_REQUEST_SAMPLING: Mapping[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "min_tokens": 0,
    "logit_bias": None,
}


def resolve_sampling(
    body: Mapping[str, Any], defaults: Mapping[str, Any], max_tokens_room: int
) -> dict[str, Any]:
    """The ``sampling_params`` vLLM builds for a chat body: a key the body sets (not null) wins,
    else the model's generation-config default (`defaults`), else vLLM's own value. A greedy
    temperature resets top_p, top_k and min_p; ``max_tokens`` is the body's limit (either
    spelling, ``max_completion_tokens`` first) or the room left in the context."""
    out: dict[str, Any] = {}
    for key, neutral in {**NEUTRAL_SAMPLING, **_REQUEST_SAMPLING}.items():
        value = body.get(key)
        if value is None:
            value = defaults.get(key, neutral)
        out[key] = value
    if out["temperature"] < 1e-5:
        out.update(top_p=1.0, top_k=0, min_p=0.0)
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    out["max_tokens"] = limit if limit is not None else max_tokens_room
    out["logprobs"] = body.get("top_logprobs", 0) if body.get("logprobs") else None
    out["skip_special_tokens"] = body.get("skip_special_tokens", True)
    return out


def weight_version_update(body: Mapping[str, Any]) -> str:
    """The new version of a ``POST /update_weight_version`` body (a string; 400 otherwise)."""
    new = body.get("new_version")
    if not isinstance(new, str) or not new:
        raise RequestError(400, "`new_version` must be a non-empty string.", param="new_version")
    return new
