"""Token-in's need of vLLM's scale-out routes: the error a call or a rollout gets without them.

Token-in calls go through vLLM's render, generate and derender routes, which vLLM serves only
when started with ``--enable-scale-out`` (without it they answer 403). Whether the upstream
serves them is an upstream fact (`UpstreamInfo.scale_out`), checked at first contact and for
each new upstream process like the others; this module turns "not served" into what the user
sees: a 503 for a call, a 409 for a rollout created asking for token-in, a ``/readyz`` problem.
"""

from __future__ import annotations

from ...errors import CaptureUnavailable, Conflict
from ..transport import ScaleOutCheck, UpstreamInfo, UpstreamTransport

__all__ = [
    "SCALE_OUT_MISSING",
    "ScaleOutMissing",
    "check_scale_out",
    "goes_token_in",
    "require_scale_out",
    "rollout_conflict",
]

#: Why token-in cannot run, one sentence naming the vLLM flag (``/readyz``, 503s, 409s).
SCALE_OUT_MISSING = (
    "token-in needs vLLM's scale-out routes (render, generate, derender), which the upstream "
    "does not serve: start vLLM with --enable-scale-out, or turn token-in off"
)


class ScaleOutMissing(CaptureUnavailable):
    """A token-in call while the upstream does not serve the scale-out routes (503)."""

    def __init__(self) -> None:
        super().__init__(
            f"{SCALE_OUT_MISSING} (--token-in off, or token_in: false for the rollout)",
            code="scale_out_disabled",
        )


def goes_token_in(rollout_choice: bool | None, setting: str) -> bool:
    """Whether a call goes token-in: the rollout's choice (``token_in`` when it was created),
    else the proxy's ``--token-in`` setting (``on`` / ``off``)."""
    return rollout_choice if rollout_choice is not None else setting == "on"


def require_scale_out(info: UpstreamInfo) -> None:
    """Raise `ScaleOutMissing` (503, ``scale_out_disabled``) when the upstream is known not to
    serve the scale-out routes; an unknown answer lets the call go on (its render fails then)."""
    if info.scale_out is False:
        raise ScaleOutMissing


async def check_scale_out(upstream: UpstreamTransport, model: str) -> UpstreamInfo:
    """The upstream's facts for a token-in call to `model`, after checking that it serves the
    scale-out routes: `ScaleOutMissing` (503) when it is known not to. Routes known missing are
    asked for again (at most every few seconds, by an upstream that can: `ScaleOutCheck`), so
    a vLLM restarted with ``--enable-scale-out`` is used without waiting for a refresh."""
    info = await upstream.info(model)
    if info.scale_out is False and isinstance(upstream, ScaleOutCheck):
        served = await upstream.scale_out_served()
    else:
        served = None
    if served:
        info = await upstream.info(model)
    require_scale_out(info)
    return info


def rollout_conflict() -> Conflict:
    """The 409 for a rollout created with ``token_in: true`` against an upstream known not to
    serve the scale-out routes."""
    return Conflict(
        f"{SCALE_OUT_MISSING} (or create the rollout without token_in: true)",
        code="scale_out_disabled",
        param="token_in",
    )
