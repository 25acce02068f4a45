"""The training request policy: what the operator and the driver impose on every call.

For RL the trainer must know the exact sampling policy behind each token, but agents send what
they like (OpenCode sends no temperature and asks for 32000 output tokens). The policy rewrites
the request before it is forwarded, and the record stores the *effective* request, so what the
trainer reads is what vLLM sampled with.

Precedence, lowest to highest::

    client  <  operator defaults (filled only where the client sent nothing)
            <  rollout policy (set by the driver in POST /admin/rollouts)
            <  operator-forced values

then the ``max_tokens`` cap and the model override. ``chat_template_kwargs`` merge key by key
at each level instead of replacing the whole object.

The output limit has two spellings, ``max_tokens`` and ``max_completion_tokens``, and vLLM reads
``max_completion_tokens`` first: a level that sets the limit under one spelling removes the other
from the request (so a client's ``max_completion_tokens: 40`` cannot beat a forced
``max_tokens: 5``), and a default limit is not added when the client set one under either name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CaptureProxyError
from ..schemas.request import RequestValidationError, validate_request

__all__ = ["POLICY_KEYS", "PolicyError", "RequestPolicy"]

#: What a policy may set. Sampling parameters and the knobs that decide what the model sees.
POLICY_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "stop_token_ids",
        "chat_template_kwargs",
        "reasoning_effort",
        "skip_special_tokens",
        "include_stop_str_in_output",
    }
)
_MERGED = "chat_template_kwargs"
#: The two spellings of the output limit: one limit, whichever name carries it.
_LIMITS = ("max_tokens", "max_completion_tokens")


class PolicyError(CaptureProxyError, ValueError):
    """A policy names a key it may not set, or a value the request schema refuses."""


def check_policy(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate a policy mapping; raises `PolicyError` naming `where` and the key."""
    if not isinstance(values, Mapping):
        raise PolicyError(f"{where} must be an object of sampling parameters")
    for key in values:
        if key not in POLICY_KEYS:
            allowed = ", ".join(sorted(POLICY_KEYS))
            raise PolicyError(f"{where}.{key} is not a policy parameter (allowed: {allowed})")
    probe = {"model": "policy-check", "messages": [{"role": "user", "content": "x"}], **values}
    try:
        validate_request(probe)
    except RequestValidationError as e:
        raise PolicyError(f"{where}.{e.param or ''}: {e.message}") from e
    return dict(values)


def _merge(base: Any, over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base) if isinstance(base, Mapping) else {}
    merged.update(over)
    return merged


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """Operator policy. Build it once at start (it validates); `apply` per call."""

    defaults: Mapping[str, Any] = field(default_factory=dict)
    force: Mapping[str, Any] = field(default_factory=dict)
    max_tokens_cap: int = 0
    model: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", check_policy(self.defaults, "policy_defaults"))
        object.__setattr__(self, "force", check_policy(self.force, "policy_force"))

    def apply(
        self, request: Mapping[str, Any], rollout: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """A new top-level request dict with the policy applied (nested values are shared)."""
        out = dict(request)
        client_limit = any(out.get(k) is not None for k in _LIMITS)
        for key, value in self.defaults.items():
            if key == _MERGED:
                out[key] = {**value, **(out.get(key) or {})}
            elif key in _LIMITS:
                if not client_limit:
                    out[key] = value
            elif key not in out or out[key] is None:
                out[key] = value
        for level in (rollout or {}, self.force):
            for key, value in level.items():
                out[key] = _merge(out.get(key), value) if key == _MERGED else value
            set_limits = [k for k in _LIMITS if k in level]
            if len(set_limits) == 1:
                # One limit: the level's spelling governs, the other one goes.
                other = _LIMITS[1] if set_limits[0] == _LIMITS[0] else _LIMITS[0]
                out.pop(other, None)
        cap = self.max_tokens_cap
        if cap:
            for key in ("max_tokens", "max_completion_tokens"):
                value = out.get(key)
                if isinstance(value, int) and value > cap:
                    out[key] = cap
            if out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
                out["max_tokens"] = cap
        if self.model:
            out["model"] = self.model
        return out

    @property
    def active(self) -> bool:
        return bool(self.defaults or self.force or self.max_tokens_cap or self.model)
