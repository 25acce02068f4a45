"""The fake vLLM's scale-out render route and RL weight-version routes.

``POST /v1/chat/completions/render`` (vLLM serves it with ``--enable-scale-out``; without, 403
"Scale-out endpoints are disabled") renders a Chat Completions body and answers a
``GenerateRequest``. Its keys, their order and their types follow the real answers captured in
tests/fixtures/vllm-0.32.0/token-in/ (render-*-response.json; docs/upstream-facts.md, "Token-in
routes"): ``sampling_params`` lists only the parameters that were set (by the request, the
model's generation config, or vLLM itself, e.g. ``skip_special_tokens: false``), not every
field of vLLM's ``SamplingParams``.

``GET /weight_info`` → ``{"weight_version": "..."}`` ("default" at start) and ``POST
/update_weight_version {"new_version": ...}`` → ``{"success": true, "new_version": ...}`` are
vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``); otherwise vLLM does not have them (404).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._generation import prompt_ends_reasoning
from ._validate import RequestError

__all__ = [
    "NEUTRAL_SAMPLING",
    "SCALE_OUT_DISABLED",
    "render_answer",
    "resolve_sampling",
    "weight_version_update",
]

#: The message of vLLM 0.32's 403 (an OpenAI error body, type PermissionDeniedError) for the
#: scale-out routes when served without ``--enable-scale-out`` (disabled-render.json).
SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)

#: vLLM's own values for the sampling parameters a generation config can set (what a request
#: gets when neither it nor the model's generation config sets them).
NEUTRAL_SAMPLING: Mapping[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def resolve_sampling(
    body: Mapping[str, Any], defaults: Mapping[str, Any], max_tokens_room: int
) -> dict[str, Any]:
    """The ``sampling_params`` a real render answers for a chat body, in its key order: a key
    the body sets (not null) wins, else the model's generation-config default (`defaults`), else
    vLLM's own value. A greedy temperature leaves top_p, top_k and min_p out; ``max_tokens`` is
    the body's limit (``max_completion_tokens`` first) or the room left in the context, left out
    when it is 16 (SamplingParams' default, as vLLM's render does);
    ``logprobs`` (the top-k count), ``seed`` and ``structured_outputs`` appear only when asked
    for."""

    def pick(key: str, neutral: Any) -> Any:
        value = body.get(key)
        return defaults.get(key, neutral) if value is None else value

    # vLLM writes its float parameters as floats (a body's `"temperature": 0` comes back 0.0).
    out: dict[str, Any] = {
        "presence_penalty": float(pick("presence_penalty", 0.0)),
        "frequency_penalty": float(pick("frequency_penalty", 0.0)),
        "repetition_penalty": float(pick("repetition_penalty", 1.0)),
        "temperature": float(pick("temperature", 1.0)),
    }
    # Greedy: measured absent (vLLM resets them). Otherwise listed with their resolved values:
    # not measured yet (every captured render was greedy), kept from the design notes.
    if out["temperature"] >= 1e-5:
        out["top_p"] = float(pick("top_p", 1.0))
        out["top_k"] = pick("top_k", 0)
        out["min_p"] = float(pick("min_p", 0.0))
        if body.get("seed") is not None:
            out["seed"] = body["seed"]
    out["stop"] = body.get("stop") or []
    out["stop_token_ids"] = body.get("stop_token_ids") or []
    # Not in a captured render (every one left them at their defaults): as SamplingParams
    # names them, so the fake's generate stops where the chat route does.
    if body.get("min_tokens"):
        out["min_tokens"] = body["min_tokens"]
    if body.get("include_stop_str_in_output") is True:
        out["include_stop_str_in_output"] = True
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    limit = limit if limit is not None else max_tokens_room
    if limit != 16:  # SamplingParams' default: a real render leaves it out (the fixtures)
        out["max_tokens"] = limit
    if body.get("logprobs"):
        out["logprobs"] = body.get("top_logprobs") or 0
    # Render asks generate for raw tokens: derender strips special tokens later (measured false
    # even when the chat body leaves it at its default, true).
    out["skip_special_tokens"] = False
    out["output_kind"] = 2  # vLLM's RequestOutputKind.FINAL_ONLY
    out["skip_clone"] = True
    if body.get("structured_outputs"):
        out["structured_outputs"] = _structured(body["structured_outputs"])
    out["bad_words"] = []
    out["skip_reading_prefix_cache"] = False
    return out


def _structured(given: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``StructuredOutputsParams`` as render writes it: every field, unset ones null."""
    fields: dict[str, Any] = {
        "json": None,
        "regex": None,
        "choice": None,
        "grammar": None,
        "json_object": None,
        "disable_any_whitespace": False,
        "disable_additional_properties": False,
        "whitespace_pattern": None,
        "structural_tag": None,
        "_backend": None,
        "_backend_was_auto": False,
    }
    return {key: given.get(key, value) for key, value in fields.items()}


def weight_version_update(body: Mapping[str, Any]) -> str:
    """The new version of a ``POST /update_weight_version`` body (a string; 400 otherwise)."""
    new = body.get("new_version")
    if not isinstance(new, str) or not new:
        raise RequestError(400, "`new_version` must be a non-empty string.", param="new_version")
    return new


def render_answer(
    body: Mapping[str, Any],
    ids: list[int],
    sampling: dict[str, Any],
    model: str,
    request_id: str,
    features: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A real render's ``GenerateRequest`` answer, keys in its order (render-*-response.json).

    ``reasoning_ended`` is true when the prompt already closed reasoning (a template given
    ``enable_thinking: false`` writes an empty ``<think></think>``; measured on the tools
    fixture; a continued assistant message whose reasoning closed: `prompt_ends_reasoning`).
    `features`: the images' (`_features.render_features`), None without. Real vLLM
    also puts ``cohere_format`` into ``chat_template_kwargs``; left out here
    (no template of the fake reads it)."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    kwargs["add_generation_prompt"] = body.get("add_generation_prompt", True) is not False
    kwargs["continue_final_message"] = bool(body.get("continue_final_message", False))
    return {
        "request_id": request_id,
        "token_ids": ids,
        "token_offsets": None,
        "features": features,
        "content_parts": None,
        "sampling_params": sampling,
        "model": model,
        "reasoning_ended": prompt_ends_reasoning(
            ids, thinking=kwargs.get("enable_thinking") is not False
        ),
        "reasoning_parser_kwargs": {"chat_template_kwargs": kwargs},
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": False,
        "stream_options": None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }
