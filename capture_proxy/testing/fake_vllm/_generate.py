"""The fake vLLM's token-in generate route: ``POST /inference/v1/generate``, sans-IO.

vLLM serves it with ``--enable-scale-out`` (403 "Scale-out endpoints are disabled" without). It
takes a render answer (a ``GenerateRequest``: ``token_ids``, ``sampling_params``, ...), possibly
with ``token_ids`` replaced, and answers the completion as token ids. Shapes, key order and types
follow the real answers in tests/fixtures/vllm-0.32.0/token-in/ (``generate-*-response.json``,
``generate-*-stream.sse``; docs/upstream-facts.md, "Token-in routes"):

- ``request_id`` is ``"generate-tokens-" + the render's request_id``; ``prompt_token_ids`` is null
  (vLLM does not echo the prompt);
- ``choices[0].token_ids`` ends with the end-of-turn id (``<|im_end|>``, 2) for a ``stop`` answer
  (sampled, so it is output), not for a ``length`` cut;
- ``weight_versions`` are half-open spans ``{version, start, end}`` over output positions; a
  version changed by ``POST /update_weight_version`` while a stream runs splits them at the token
  where it landed;
- streamed: one ``data:`` event per token whose choice has ``weight_versions: null`` except the
  last token's event (the whole completion's spans), then with ``stream_options.include_usage`` a
  usage event with ``choices: []``, then ``data: [DONE]``.

The completion comes from the fake's own generation (`_generation.plan_answer`): the same `Turn`
that answers a chat call answers a generate call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._generation import Plan
from ._protocol import DONE, sse
from ._validate import RequestError

__all__ = [
    "Generation",
    "check_generate",
    "generate_body",
    "generate_events",
    "spans_of",
]


@dataclass
class Generation:
    """One token-in generation: the plan, how many tokens of it were generated, their logprobs
    and the weight version that sampled each (filled as tokens are emitted)."""

    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    plan: Plan
    n: int
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]
    #: ``sampling_params.logprobs``: the top-k count, or None when logprobs were not asked for.
    top_k: int | None
    versions: list[str] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.plan.ids[: self.n]

    @property
    def finish_reason(self) -> str:
        # Generate knows no tool parser: a completed answer is "stop" (measured on the tools
        # fixture, whose answer is a tool call); "tool_calls" is derender's word.
        reason = self.plan.finish(self.n)
        return "stop" if reason == "tool_calls" else reason


def check_generate(body: Mapping[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """The prompt ids and sampling params of a generate body; vLLM's 400 otherwise."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise RequestError(
            400, "`token_ids` must be a non-empty list of integers.", param="token_ids"
        )
    sampling = body.get("sampling_params")
    if sampling is None:
        sampling = {}
    if not isinstance(sampling, dict):
        raise RequestError(400, "`sampling_params` must be an object.", param="sampling_params")
    limit = sampling.get("max_tokens")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise RequestError(400, f"max_tokens must be at least 1, got {limit}.", param="max_tokens")
    return ids, sampling


def spans_of(versions: list[str]) -> list[dict[str, Any]]:
    """Half-open ``[start, end)`` spans of equal versions over output positions."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def _logprobs(g: Generation, lo: int, hi: int) -> dict[str, Any] | None:
    if g.top_k is None:
        return None
    content = []
    for k in range(lo, hi):
        tops = [
            {"token_id": alt, "logprob": lp, "rank": j + 1}
            for j, (alt, lp) in enumerate(g.tops[k][: g.top_k])
        ]
        content.append(
            {"token_id": g.ids[k], "logprob": g.logprobs[k], "rank": 1, "top_logprobs": tops}
        )
    return {"content": content}


def _choice(g: Generation, lo: int, hi: int, *, last: bool) -> dict[str, Any]:
    return {
        "index": 0,
        "finish_reason": g.finish_reason if last else None,
        "stop_reason": g.plan.stop_reason_at(g.n) if last else None,
        "token_ids": g.ids[lo:hi],
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": spans_of(g.versions) if last else None,
        "logprobs": _logprobs(g, lo, hi),
    }


def generate_body(g: Generation) -> dict[str, Any]:
    """The unary answer, key for key in the order of ``generate-*-response.json``."""
    n, prompt = g.n, len(g.prompt_ids)
    return {
        "request_id": g.request_id,
        "model": g.model,
        "created": g.created,
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + n,
            "completion_tokens": n,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [_choice(g, 0, n, last=True)],
    }


def generate_events(
    g: Generation, version_now: Callable[[], str], *, include_usage: bool
) -> Iterator[bytes]:
    """The streamed answer's events, as ``generate-*-stream.sse``: one per token, the usage event
    (when asked), ``[DONE]``. ``version_now`` is read as each token is emitted, so a weight update
    between two events splits the spans there."""
    n = g.n
    for k in range(n):
        g.versions.append(version_now())
        event = {
            "request_id": g.request_id,
            "usage": None,
            "output_mode": "tokens",
            "choices": [_choice(g, k, k + 1, last=k == n - 1)],
        }
        yield sse(event)
    if include_usage:
        prompt = len(g.prompt_ids)
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n}
        yield sse(
            {"request_id": g.request_id, "usage": usage, "output_mode": "tokens", "choices": []}
        )
    yield DONE
